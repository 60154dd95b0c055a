"""Qualification before traffic: Gate 1 (quality invariants), Gate 2 (the end-to-end ledger) and the
D and mechanism sweep of a bundle against standard decoding of the same target, bound to its card."""

from .dataset import Dataset, QualificationRequest, load_dataset
from .procedure import Endpoint, QualifyPlan, qualify_bundle

__all__ = ["Dataset", "Endpoint", "QualificationRequest", "QualifyPlan", "load_dataset", "qualify_bundle"]
