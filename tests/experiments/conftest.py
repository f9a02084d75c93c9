"""The experiments' tests see none of the SFT starts the repository keeps for the claims'
sweeps (docs/claims/starts): a start kept there for a claim would otherwise replace the
start a test trains. A test that keeps starts points ``STARTS_DIR`` at its own."""

import pytest

from experiments import starts


@pytest.fixture(autouse=True)
def _no_kept_starts(tmp_path_factory, monkeypatch):
    monkeypatch.setattr(starts, "STARTS_DIR", str(tmp_path_factory.mktemp("no_kept_starts")))
