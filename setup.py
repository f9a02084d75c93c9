"""policyopt: policy optimisation for language models with verifiable rewards, in JAX."""

from setuptools import find_packages, setup

# Versions are bounded to the ranges the test suite has been run against.
INSTALL_REQUIRES = [
    "jax>=0.10.2,<0.12",
    "flax>=0.12.8,<0.13",
    "optax>=0.2.8,<0.3",
    "orbax-checkpoint>=0.12.8,<0.13",
    "chex>=0.1.92,<0.2",
    "ml-collections>=1.1.0,<1.2",
    "absl-py>=2.3,<3",
    "numpy>=2.0,<3",
    # Data: tfds builders (array_record files, no TensorFlow needed) read through grain.
    "tensorflow-datasets>=4.9.10,<4.10",
    "array-record>=0.8.6,<0.9",
    "grain>=0.2.18,<0.3",
    # Tokenizers and checkpoints of real models.
    "tokenizers>=0.23,<0.24",
    "safetensors>=0.8,<0.9",
    # Rewards: the math verifier of the open RL community, and an offline language-id
    # model that ships inside its package (used for Magistral's language reward).
    "math-verify>=0.9.0,<0.10",
    "py3langid>=0.4.0,<0.5",
    # Logging and plots.
    "tensorboardX>=2.6.5,<2.7",
    "matplotlib>=3.9,<3.12",
]

# Experiment trackers of `train.loggers` (policyopt/loggers.py), each an extra.
WANDB_REQUIRES = ["wandb>=0.30,<0.32"]
# The MLflow client without its server and UI dependencies (a file store or a tracking
# server's URI is all a run needs).
MLFLOW_REQUIRES = ["mlflow-skinny>=3.17,<3.19"]
# Starting from a HuggingFace checkpoint (`model.pretrained`): policyopt reads the folder
# itself (safetensors, tokenizer.json); transformers brings `hf download`, which fetches
# one, and loads the folders `save_pretrained` exports.
HF_REQUIRES = ["transformers>=5.23,<6"]

TEST_REQUIRES = [
    "pytest>=9.0,<10",
    "pytest-xdist>=3.8,<4",
    # The reference implementation the models are checked against (CPU build).
    "torch==2.13.0",
    *HF_REQUIRES,
    # The loggers' tests (tests/test_loggers.py) run them offline.
    *WANDB_REQUIRES,
    *MLFLOW_REQUIRES,
]

setup(
    name="policyopt",
    version="0.1.0",
    description=__doc__,
    packages=find_packages(include=["policyopt", "policyopt.*"]),
    python_requires=">=3.11,<3.13",
    install_requires=INSTALL_REQUIRES,
    # `pip install -e .[tensorboard]`: the TensorBoard app, to read the event files that
    # runs write (tensorboardX, installed above, writes them).
    extras_require={
        "test": TEST_REQUIRES,
        "wandb": WANDB_REQUIRES,
        "mlflow": MLFLOW_REQUIRES,
        "hf": HF_REQUIRES,
        "tensorboard": ["tensorboard>=2.16,<3"],
        # `make lint` / `make format`: the formatter and linter of pyproject.toml.
        "lint": ["ruff>=0.17.6,<0.18"],
    },
)
