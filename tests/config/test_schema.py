"""The config schema (`policyopt.config`): one place for each field's default, doc, paper
and check; the ConfigDict, the typed sections, `--print_config` and docs/configuration.md
all come from it."""

import dataclasses
import os

import pytest

from configs import base, grpo, sapo
from policyopt import config as schema_config
from policyopt import schema
from policyopt.config import reference
from policyopt.rl.loop import build
from tests.flags import ROOT


def test_base_config_is_the_schema_at_its_defaults():
    config = base.base_config()
    typed = schema_config.from_configdict(config)
    assert typed == schema_config.RunConfig()
    assert set(build.config_record(config)) == set(reference.field_index())
    assert hash(typed) == hash(schema_config.RunConfig())  # frozen: a static jit argument


def test_every_field_has_a_one_line_doc():
    for path, field in reference.field_index().items():
        assert field.doc.endswith(".") and "\n" not in field.doc, path
        assert len(field.doc) <= 160, (path, len(field.doc))


def test_print_config_puts_each_fields_own_comment_above_it():
    lines = base.describe(sapo.get_config()).splitlines()
    index = reference.field_index()
    for path, field in index.items():
        at = next(i for i, line in enumerate(lines) if line.startswith(f"{path} = "))
        above = []
        for line in reversed(lines[:at]):
            if not line.startswith("# ") or line.startswith("# ----"):
                break
            above.insert(0, line[2:])
        assert " ".join(above).startswith(field.doc[:40]), path


def test_the_typed_sections_are_the_recipes_values():
    config = sapo.get_config("algo.tau_neg=1.2,batch.response_buckets=(8,16,32)")
    typed = base.check(config)
    assert typed.algo.tau_neg == 1.2 and typed.algo.method == "sapo"
    assert typed.batch.response_buckets == (8, 16, 32)
    assert typed.to_dict() == config.to_dict()
    with pytest.raises(dataclasses.FrozenInstanceError):
        typed.algo.tau_neg = 2.0  # the sections are read-only


def test_a_checks_rule_and_message_name_the_field():
    check = schema.number(0.0, 1.0)
    assert check.rule == "number >= 0.0 and <= 1.0"
    with pytest.raises(ValueError, match=r"^config\.optim\.b1 must be a finite number >= 0\.0"):
        check("config.optim.b1", 1.5)
    with pytest.raises(ValueError, match=r"^config\.train\.log_every must be an int >= 1, got 0"):
        base.check(grpo.get_config("train.log_every=0"))


def test_the_reference_page_is_generated_from_the_schema():
    path = os.path.join(ROOT, reference.PAGE)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert reference.blocks(text) == reference.sections(), (
        f"{reference.PAGE} must hold one generated block per section"
    )
    assert reference.update_page(text) == text, (
        f"{reference.PAGE} is stale: run `{reference.COMMAND}` (python -m experiments.config_docs)"
    )
    for path_ in reference.field_index():
        assert f"- `{path_} = " in text, path_
