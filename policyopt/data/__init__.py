"""Data: tokenizers, the synthetic arithmetic task, local JSONL math (and code) files, tfds
builders and grain pipelines.

The tfds builders (`policyopt.data.tfds_builders`) are not imported here, so that
`import policyopt.data` stays light; import that module to use them.
"""

from policyopt.data.jsonl import (
    JsonlConfig,
    JsonlReport,
    MalformedRowError,
    extract_reference,
    last_boxed,
    read_math_jsonl,
)
from policyopt.data.pipeline import (
    DEFAULT_BUCKETS,
    LengthReport,
    Pipeline,
    as_record,
    bucket_length,
    make_pipeline,
    pad_to_bucket,
)
from policyopt.data.synthetic import (
    ArithmeticConfig,
    add_without_carry,
    column_sums,
    evaluate,
    format_response,
    generate_arithmetic,
    iter_arithmetic,
    prompt_text,
    read_columns,
    solve,
    split_of,
)
from policyopt.data.tokenizer import (
    BOXED_CLOSE,
    BOXED_OPEN,
    THINK_CLOSE,
    THINK_OPEN,
    CharTokenizer,
    HFTokenizer,
    load_tokenizer,
)
