"""Data: tokenizers, the synthetic arithmetic task, local JSONL math files, tfds builders
and grain pipelines."""

from policyopt.data.synthetic import (
    ArithmeticConfig,
    add_without_carry,
    column_sums,
    evaluate,
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
