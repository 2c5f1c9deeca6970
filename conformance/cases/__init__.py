"""Cases as data: the structure of one op invocation, its features, its values and its replay file."""

from .case import DTYPES, ODD_HIDDEN_SIZES, REAL_HIDDEN_SIZES, Case
from .features import FEATURE_DOCS, case_features
from .values import generator_for

__all__ = ["DTYPES", "FEATURE_DOCS", "ODD_HIDDEN_SIZES", "REAL_HIDDEN_SIZES", "Case", "case_features", "generator_for"]
