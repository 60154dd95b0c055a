"""Kafka for the whole product: config and security, topic names, reader and writer, the decision codec and signatures."""
