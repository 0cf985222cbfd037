"""The data layer shared by benchmarks, tests and training jobs: synthetic heavy-tailed ids,
"dlrm-small" batches, a Criteo-shaped synthetic stream and a Criteo TSV reader."""

from torchrec_ext.data.criteo import (
    CAT_FEATURE_COUNT,
    DEFAULT_CAT_NAMES,
    DEFAULT_INT_NAMES,
    INT_FEATURE_COUNT,
    CriteoTsvReader,
    parse_criteo_lines,
)
from torchrec_ext.data.synthetic import (
    CRITEO_1TB_CARDINALITIES,
    HeavyTailedIds,
    SyntheticCriteo,
    dlrm_small_batch,
    generator,
    mix64,
    table_key,
)

__all__ = [
    "CAT_FEATURE_COUNT",
    "CRITEO_1TB_CARDINALITIES",
    "CriteoTsvReader",
    "DEFAULT_CAT_NAMES",
    "DEFAULT_INT_NAMES",
    "HeavyTailedIds",
    "INT_FEATURE_COUNT",
    "SyntheticCriteo",
    "dlrm_small_batch",
    "generator",
    "mix64",
    "parse_criteo_lines",
    "table_key",
]
