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

TEST_REQUIRES = [
    "pytest>=9.0,<10",
    "pytest-xdist>=3.8,<4",
    # The reference implementation the models are checked against (CPU build).
    "torch==2.13.0",
    "transformers>=5.23,<6",
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
        "tensorboard": ["tensorboard>=2.16,<3"],
        # `make lint` / `make format`: the formatter and linter of pyproject.toml.
        "lint": ["ruff>=0.17.6,<0.18"],
    },
)
