"""`specwatch gateway`: fallback by routing, with telemetry from unmodified vLLM servers.

An OpenAI-compatible proxy in front of a speculative and a standard pool (docs/DEPLOY.md, "The gateway").
"""

from .embedded import EmbeddedFeed
from .evidence import CARD_FIELDS_UNSEEN, card_from_server
from .metrics import GatewayMetrics
from .proxy import Gateway, GatewaySettings, build_app
from .routing import LabelRule, LabelRules, Route, assign_labels, choose_route

__all__ = ["CARD_FIELDS_UNSEEN", "EmbeddedFeed", "Gateway", "GatewayMetrics", "GatewaySettings", "LabelRule",
           "LabelRules", "Route", "assign_labels", "build_app", "card_from_server", "choose_route"]
