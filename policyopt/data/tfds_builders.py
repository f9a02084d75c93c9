"""tensorflow-datasets builders for the task data, written as array_record files.

They work without TensorFlow: `GeneratorBasedBuilder` + `file_format="array_record"`
writes the examples with array_record, and `builder.as_data_source(split)` reads them
back as a random-access sequence of dicts (text fields come back as `bytes`;
`policyopt.data.pipeline` decodes them), which is what a grain `MapDataset` wants.
(`as_dataset`, the tf.data reader, is the one part of tfds that needs TensorFlow.)

```
builder = build_arithmetic(data_dir, ArithmeticConfig(wrong_procedure_fraction=0.6),
                           seed=0, train_size=10_000, test_size=512)
train = builder.as_data_source("train")      # len(train) == 10_000; train[i] a dict
```

The examples keep the generation order (`disable_shuffling=True`), so `train[i]` is the
i-th record of `generate_arithmetic`. A builder config's name is derived from its
content (for JSONL files, from the files' bytes too), so different settings never share
a prepared directory and a prepared dataset is reused only when it is the same data.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import tensorflow_datasets as tfds
from etils import epath

from policyopt.data import jsonl, synthetic

_TEXT_FIELDS = ("prompt", "answer", "solution")


def _text_features(names) -> tfds.features.FeaturesDict:
    return tfds.features.FeaturesDict({name: tfds.features.Text() for name in names})


class _Builder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Base of the builders here: `code_path` given directly.

    tfds 4.9.10 finds a builder's source file through `importlib_resources`, a backport it
    only requires on Python < 3.9, so `download_and_prepare` of any builder defined in an
    installed package fails with `ModuleNotFoundError: importlib_resources` on 3.11. The
    file is this module; saying so skips the lookup.
    """

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        return epath.Path(__file__)


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "big") + part)
    return h.hexdigest()[:12]


# ---------------------------------------------------------------------------------------
# Synthetic arithmetic


@dataclasses.dataclass(eq=False)
class ArithmeticBuilderConfig(tfds.core.BuilderConfig):
    """Which synthetic records to write: the task knobs, the seed and the split sizes."""

    task: synthetic.ArithmeticConfig = synthetic.ArithmeticConfig()
    seed: int = 0
    train_size: int = 10_000
    test_size: int = 512


def arithmetic_builder_config(
    task: synthetic.ArithmeticConfig = synthetic.ArithmeticConfig(),
    *,
    seed: int = 0,
    train_size: int = 10_000,
    test_size: int = 512,
) -> ArithmeticBuilderConfig:
    """A config named by its content (`seed0_10000x512_<hash of the knobs>`)."""
    fields = dataclasses.asdict(task)
    if not task.remainders:  # knobs that do not change the records keep the names of before
        del fields["min_steps"], fields["max_steps"]
    knobs = json.dumps(fields, sort_keys=True).encode()
    name = f"seed{seed}_{train_size}x{test_size}_{_digest(knobs)}"
    return ArithmeticBuilderConfig(
        name=name,
        description=f"{task}",
        task=task,
        seed=seed,
        train_size=train_size,
        test_size=test_size,
    )


class PolicyoptArithmetic(_Builder):
    """The synthetic arithmetic task (`policyopt.data.synthetic`), train and test splits."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Column-sum traces; forgotten-carry wrong procedure."}
    BUILDER_CONFIGS = [arithmetic_builder_config()]

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=synthetic.__doc__.split("\n\n")[0],
            features=_text_features(_TEXT_FIELDS + ("wrong_answer",)),
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # Nothing to download.
        return {
            "train": self._generate_examples("train", self.builder_config.train_size),
            "test": self._generate_examples("test", self.builder_config.test_size),
        }

    def _generate_examples(self, split: str, size: int):
        config = self.builder_config
        records = synthetic.generate_arithmetic(
            config.task, split=split, seed=config.seed, num_examples=size
        )
        for index, record in enumerate(records):
            yield index, record


# ---------------------------------------------------------------------------------------
# Local JSONL math files


@dataclasses.dataclass(eq=False)
class MathJsonlBuilderConfig(tfds.core.BuilderConfig):
    """Local JSONL files per split (e.g. {"train": "gsm8k_train.jsonl"}) and how to read them."""

    files: tuple[tuple[str, str], ...] = ()  # ((split, path), ...)
    reader: jsonl.JsonlConfig = jsonl.JsonlConfig()


def math_jsonl_builder_config(
    files: dict[str, str | os.PathLike], reader: jsonl.JsonlConfig = jsonl.JsonlConfig()
) -> MathJsonlBuilderConfig:
    """A config named by the reader settings and the files' contents (`jsonl_<hash>`)."""
    if not files:
        raise ValueError("math_jsonl_builder_config needs at least one {split: path}")
    parts = [json.dumps(dataclasses.asdict(reader), sort_keys=True).encode()]
    items = []
    for split, path in sorted(files.items()):
        path = os.path.abspath(os.fspath(path))
        with open(path, "rb") as f:
            parts += [split.encode(), f.read()]
        items.append((split, path))
    return MathJsonlBuilderConfig(
        name=f"jsonl_{_digest(*parts)}",
        files=tuple(items),
        reader=reader,
        description=", ".join(p for _, p in items),
    )


class PolicyoptMathJsonl(_Builder):
    """Math or code problems (or both) from local JSONL files (`policyopt.data.jsonl`), one
    split per file.

    Malformed rows raise `MalformedRowError` (file:line) unless the reader config skips
    them; skipped rows are counted per split in `builder.info.metadata["jsonl_reports"]`.
    """

    # Bump when `policyopt.data.jsonl` reads rows differently: the directory's name hashes
    # the reader settings and the files, not the reading code.
    VERSION = tfds.core.Version("1.1.0")
    RELEASE_NOTES = {
        "1.0.0": "prompt / answer / solution text.",
        "1.1.0": "code problems (tests as JSON text, MBPP setup, fenced solutions) and mixed "
        "files (a task field).",
    }

    def _info(self) -> tfds.core.DatasetInfo:
        # Mixed math and code files: each record also says its task.
        mixed = self.builder_config is not None and self.builder_config.reader.task == "mixed"
        fields = _TEXT_FIELDS + (("task",) if mixed else ())
        return tfds.core.DatasetInfo(
            builder=self,
            features=_text_features(fields),
            metadata=tfds.core.MetadataDict(),
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager):
        del dl_manager
        if not self.builder_config.files:
            raise ValueError("PolicyoptMathJsonl needs a config from math_jsonl_builder_config()")
        self.info.metadata["jsonl_reports"] = {}
        return {
            split: self._generate_examples(split, path) for split, path in self.builder_config.files
        }

    def _generate_examples(self, split: str, path: str):
        records, report = jsonl.read_math_jsonl(path, self.builder_config.reader)
        self.info.metadata["jsonl_reports"][split] = dataclasses.asdict(report)
        for index, record in enumerate(records):
            yield index, record


# ---------------------------------------------------------------------------------------
# Building


def prepare(
    builder: tfds.core.DatasetBuilder, *, progress_bar: bool = False, download: bool = True
):
    """`download_and_prepare` (a no-op when already prepared); returns the builder.

    tfds only has a process-wide switch for its progress bars; `progress_bar=False`
    turns them off for the rest of the process. With `download=False` the data must be
    prepared already (e.g. by another process): `FileNotFoundError` otherwise.
    """
    if not download:
        if not builder.is_prepared():
            raise FileNotFoundError(
                f"{builder.name} is not prepared in {builder.data_dir} (with "
                "several processes, the directory must be shared by all)"
            )
        return builder
    tfds.display_progress_bar(progress_bar)
    builder.download_and_prepare()
    return builder


def build_arithmetic(
    data_dir: str | os.PathLike,
    task: synthetic.ArithmeticConfig = synthetic.ArithmeticConfig(),
    *,
    seed: int = 0,
    train_size: int = 10_000,
    test_size: int = 512,
    download: bool = True,
) -> PolicyoptArithmetic:
    """Prepares (or reuses; with `download=False` only reuses) the synthetic task under
    `data_dir`; returns the builder."""
    config = arithmetic_builder_config(task, seed=seed, train_size=train_size, test_size=test_size)
    return prepare(
        PolicyoptArithmetic(
            data_dir=os.fspath(data_dir), config=config, file_format="array_record"
        ),
        download=download,
    )


def build_math_jsonl(
    data_dir: str | os.PathLike,
    files: dict[str, str | os.PathLike],
    reader: jsonl.JsonlConfig = jsonl.JsonlConfig(),
    *,
    download: bool = True,
) -> PolicyoptMathJsonl:
    """Prepares (or reuses; with `download=False` only reuses) local JSONL files under
    `data_dir`; returns the builder."""
    config = math_jsonl_builder_config(files, reader)
    return prepare(
        PolicyoptMathJsonl(data_dir=os.fspath(data_dir), config=config, file_format="array_record"),
        download=download,
    )
