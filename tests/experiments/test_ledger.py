"""The claims' runs kept in the repository (experiments/ledger.py): a record per finished
run, found again only for the same arm, start, seed, start identity and config; the start's
identity follows its saved bits; the config's digest ignores what a resumed run may change
and keeps what a record reports. The ledger in a claim's sweep (another machine resuming
and judging from it) is tested with the tiny claim in test_reproduce.py."""

import json
import os
import subprocess

import numpy as np
import pytest

from configs import testbed_long
from experiments import ablate, ledger, starts
from experiments.ledger import Ledger, config_key, ledger_path, start_id
from policyopt.checkpoint import Checkpointer, CheckpointError
from policyopt.rl.loop.build import resolved_record
from tests.flags import ROOT


def _run(**figures):
    return {
        "start": 1,
        "seed": 0,
        "run_dir": "runs/claims/x/start1_seed0",
        "wall_s": 700.0,
        "cpu_s": 1300.0,
        "regime": {"optim.lr": 3e-5, "train.num_iterations": 100},
        "iterations": 100,
        **figures,
    }


def test_a_record_is_found_only_for_its_run_start_and_config(tmp_path):
    path = str(tmp_path / "docs" / "claim.jsonl")
    book = Ledger(path)
    assert book.records == [] and book.start_ids(1) == []
    record = book.add("gspo", 1, 0, "1000-aa", "k1", _run(**{"pass@1_end": 0.5}))
    assert record["figures"] == {"iterations": 100, "pass@1_end": 0.5}
    assert record["regime"] == {"optim.lr": 3e-5, "train.num_iterations": 100}
    assert (record["wall_s"], record["cpu_s"]) == (700.0, 1300.0)
    # Recorded once: the same run added again is the record already there.
    assert book.add("gspo", 1, 0, "1000-aa", "k1", _run(**{"pass@1_end": 0.9})) == record
    book.add("gspo", 1, 0, "1000-bb", "k1", _run(**{"pass@1_end": 0.4}))  # start retrained
    again = Ledger(path)  # what another process, or a fresh clone, reads
    assert len(again.records) == 2 and len(open(path).read().splitlines()) == 2
    assert again.find("gspo", 1, 0, "1000-aa", "k1")["figures"]["pass@1_end"] == 0.5
    assert again.find("gspo", 1, 0, "1000-bb", "k1")["figures"]["pass@1_end"] == 0.4
    for other in (("grpo", 1, 0, "1000-aa", "k1"), ("gspo", 2, 0, "1000-aa", "k1")):
        assert again.find(*other) is None
    assert again.find("gspo", 1, 1, "1000-aa", "k1") is None
    assert again.find("gspo", 1, 0, "1000-aa", "k2") is None  # another config
    assert again.start_ids(1) == ["1000-aa", "1000-bb"] and again.start_ids(2) == []
    assert again.start_ids(1, {"k1"}) == ["1000-aa", "1000-bb"] and again.start_ids(1, {"k2"}) == []
    run = Ledger.run_of(again.records[0])
    assert run["run_dir"] is None and (run["start"], run["seed"]) == (1, 0)
    assert run["pass@1_end"] == 0.5 and run["regime"] == record["regime"]
    assert run["wall_s"] == 700.0 and run["iterations"] == 100


def test_a_line_that_is_not_a_record_is_named(tmp_path):
    path = tmp_path / "claim.jsonl"
    good = {"arm": "a", "start": 1, "seed": 0, "start_id": "x", "config": "k"}
    good.update(regime={}, figures={})
    path.write_text(json.dumps(good) + "\n\n" + '{"arm": "a", "start": 1}\n')
    with pytest.raises(ValueError, match=r"claim.jsonl:3 is not a run record \('seed'\)"):
        Ledger(str(path))
    path.write_text(json.dumps(good) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"claim.jsonl:2 is not a run record"):
        Ledger(str(path))
    # Without what a judged run reads (its regime, its figures): named here, not a bare
    # KeyError (or a TypeError's traceback) from the sweep that judges it.
    for broken in ({"regime": {}}, {"figures": {}}, {"regime": {}, "figures": [0.5]}):
        record = {k: v for k, v in good.items() if k not in ("regime", "figures")}
        path.write_text(json.dumps(good) + "\n" + json.dumps({**record, **broken}) + "\n")
        with pytest.raises(ValueError, match=r"claim.jsonl:2 is not a run record"):
            Ledger(str(path))


def test_the_ledger_of_a_claim_lies_in_the_repositorys_docs():
    assert ledger_path("runs/claims/routing_replay/") == ledger.os.path.join(
        ledger.LEDGER_DIR, "routing_replay.jsonl"
    )
    assert ledger.LEDGER_DIR.replace("\\", "/").endswith("docs/claims/runs")


def test_the_ledger_is_committed_not_ignored_as_a_run_directory():
    """A claim's ledger is committed with its verdict; the repository ignores run
    directories (``runs/``) at any depth, docs/claims/runs too: ``git add`` refused the
    ledger and ``git status`` never showed it, so a fresh clone had no record to judge."""
    path = os.path.relpath(ledger_path("routing_replay"), ROOT)
    checked = subprocess.run(["git", "check-ignore", "--no-index", "-v", path], cwd=ROOT)
    if checked.returncode == 128:  # not a git checkout (an sdist)
        pytest.skip("not a git checkout")
    assert checked.returncode == 1, f"{path} is ignored"


def _state(w, mu=0.0):
    return {"train": {"params": {"w": w}, "opt_state": {"mu": np.full(3, mu, np.float32)}}}


def test_the_start_id_follows_the_saved_parameters_bits(tmp_path):
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    for name, state in (("a", _state(w)), ("b", _state(w)), ("d", _state(w, mu=1.0))):
        with Checkpointer(str(tmp_path / name)) as saved:
            saved.save(3, state, {"config": {}})
    flipped = w.copy()
    flipped[1, 2] = np.nextafter(flipped[1, 2], np.float32(9))  # one bit
    with Checkpointer(str(tmp_path / "c")) as saved:
        saved.save(3, _state(flipped), {"config": {}})
    first = start_id(str(tmp_path / "a"))
    assert first.startswith("3-") and len(first) == 2 + 16
    assert start_id(str(tmp_path / "b")) == first  # the same bits elsewhere: the same start
    assert start_id(str(tmp_path / "c")) != first
    # The optimiser state is not the start's: RL starts from the parameters alone (and a
    # start kept in the repository holds nothing else, experiments/starts.py).
    assert start_id(str(tmp_path / "d")) == first
    with Checkpointer(str(tmp_path / "e")) as saved:
        saved.save(3, {"train": {"opt_state": {"mu": np.zeros(3, np.float32)}}}, {})
    with pytest.raises(ValueError, match="holds no parameters"):
        start_id(str(tmp_path / "e"))
    state = _state(w)
    with Checkpointer(str(tmp_path / "a")) as saved:  # the latest checkpoint names it
        saved.save(4, state, {"config": {}})
    assert start_id(str(tmp_path / "a")).startswith("4-")
    # Damaged checksums: no identity, an error naming the checkpoint.
    for item in (tmp_path / "b" / "3" / "checksums").iterdir():
        item.unlink()
    (tmp_path / "b" / "3" / "checksums").rmdir()
    with pytest.raises(CheckpointError, match="checksums"):
        start_id(str(tmp_path / "b"))


def _key(**changes):
    config = testbed_long.get_config()
    config.unlock()
    for field, value in changes.items():
        section, name = field.split(".") if "." in field else (None, field)
        (config[section] if section else config)[name] = value
    config.lock()
    return config_key(resolved_record(ablate._flat(config.to_dict())))


def test_the_config_key_ignores_layout_and_keeps_what_a_record_reports():
    base = _key()
    assert len(base) == 16 and _key() == base
    # Layout, cadence, logging and the start's path: the same experiment.
    for same in (
        {"model.moe_block_size": 256},
        {"train.log_every": 7},
        {"train.checkpoint_every": 3},
        {"init_checkpoint": "elsewhere/checkpoints"},
        {"sft.steps": 999},
    ):
        assert _key(**same) == base, same
    # The budget, the evaluation, the routing metrics, the method: another record.
    for other in (
        {"train.num_iterations": 101},
        {"eval.num_prompts": 128},
        {"train.routing_metrics": True},
        {"optim.lr": 2e-5},
        {"seed": 5},
        # Fewer asynchronous generation rows than n_async: fewer completions in flight,
        # another staleness (its bound, async/staleness_mean), not another layout.
        {"async_mode.num_slots": 16},
    ):
        assert _key(**other) != base, other


def test_a_critic_of_its_own_counts_by_its_checkpoints_bits_not_its_path(tmp_path):
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    flipped = w.copy()
    flipped[0, 0] = np.nextafter(flipped[0, 0], np.float32(9))
    for name, params in (("here", w), ("moved", w), ("other", flipped)):
        with Checkpointer(str(tmp_path / name / "checkpoints")) as saved:
            saved.save(5, _state(params), {"config": {}})
    keys = {
        name: _key(**{"critic.init_checkpoint": str(tmp_path / name / "checkpoints")})
        for name in ("here", "moved", "other")
    }
    assert keys["here"] == keys["moved"]  # copied elsewhere: the same run
    assert keys["other"] != keys["here"]  # one bit of the critic's start: another run
    assert _key() not in keys.values()  # the policy's copy as critic: another run
    missing = str(tmp_path / "gone" / "checkpoints")
    with pytest.raises(FileNotFoundError, match="critic.init_checkpoint"):
        _key(**{"critic.init_checkpoint": missing})
    assert not os.path.exists(missing)


def test_a_record_added_after_a_cut_off_line_keeps_a_line_of_its_own(tmp_path):
    """Another process appending to the claim's ledger was killed mid-write (or its disk
    filled): its line stops without a newline. A record added after it by a sweep still
    running must not be joined to that line (and lost when the line is removed): the
    cut-off line is named, and the record stays readable once it is removed."""
    path = tmp_path / "claim.jsonl"
    book = Ledger(str(path))
    book.add("gspo", 1, 0, "1000-aa", "k1", _run(**{"pass@1_end": 0.5}))
    with open(path, "a") as f:  # the other process's record, cut off
        f.write('{"arm": "grpo", "config": "k1", "figu')
    book.add("gspo", 1, 1, "1000-aa", "k1", _run(**{"pass@1_end": 0.6}))
    with pytest.raises(ValueError, match=r"claim.jsonl:2 is not a run record"):
        Ledger(str(path))
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:1] + lines[2:]) + "\n")  # "fix or remove that line"
    again = Ledger(str(path))
    assert [(r["seed"], r["figures"]["pass@1_end"]) for r in again.records] == [(0, 0.5), (1, 0.6)]


def test_two_machines_ledgers_merge_with_every_record(tmp_path):
    """Two machines sweep one claim (different arms, or one resuming the other's sweep) and
    each commits the records it added at the end of the ledger: git merges the two
    branches with both sides' lines (the repository's .gitattributes), not a conflict
    whose careless resolution drops one machine's runs."""
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    repo = tmp_path / "clone"
    repo.mkdir()
    run = lambda *args: subprocess.run([*git, *args], cwd=repo, capture_output=True, text=True)
    if run("init", "-q").returncode != 0:
        pytest.skip("no git")
    attributes = os.path.join(ROOT, ".gitattributes")
    if os.path.exists(attributes):
        (repo / ".gitattributes").write_text(open(attributes).read())
    path = repo / os.path.relpath(ledger_path("routing_replay"), ROOT)
    path.parent.mkdir(parents=True)
    path.write_text('{"line": 0}\n')
    assert run("add", "-A").returncode == 0 and run("commit", "-qm", "0").returncode == 0
    for branch, line in (("a", 1), ("b", 2)):
        run("checkout", "-q", "-b", branch, "main")
        path.write_text(path.read_text() + json.dumps({"line": line}) + "\n")
        assert run("commit", "-qam", branch).returncode == 0
    run("checkout", "-q", "a")
    merged = run("merge", "-q", "b", "-m", "merge")
    assert merged.returncode == 0, merged.stdout + merged.stderr
    assert sorted(json.loads(x)["line"] for x in path.read_text().splitlines()) == [0, 1, 2]


def test_the_list_counts_a_claims_recorded_runs_per_start(tmp_path, monkeypatch, capsys):
    """--list reads a sweep's progress from the ledger: the claim's own runs (a run
    recorded twice, from two identities of its start, counts once; runs of other arms,
    starts or seeds not at all) and their CPU-hours."""
    from configs.claims import get_claim  # noqa: PLC0415
    from experiments import reproduce  # noqa: PLC0415
    from experiments.reproduce import recorded_runs  # noqa: PLC0415

    claim = get_claim("vapo_length_adaptive")  # 4 arms x starts 1, 2 x seeds 0-4
    arm = claim.arm_labels()[0]
    book = Ledger(str(tmp_path / "vapo_length_adaptive.jsonl"))
    book.add(arm, 1, 0, "a", "k", _run(cpu_s=1800.0))
    book.add(arm, 1, 0, "b", "k", _run(cpu_s=1800.0))  # its start retrained: the same run
    book.add(arm, 2, 3, "c", "k", _run(cpu_s=3600.0))
    book.add(arm, 3, 0, "d", "k", _run(cpu_s=99.0))  # a start outside the claim's
    book.add(arm, 1, 7, "a", "k", _run(cpu_s=99.0))  # a seed outside it
    book.add("not_an_arm", 1, 1, "a", "k", _run(cpu_s=99.0))
    monkeypatch.setattr(starts, "STARTS_DIR", str(tmp_path / "kept"))  # none kept
    line = recorded_runs(claim, book)
    assert line.startswith(
        "2 of 40 runs (start 1: 1 (start not kept), start 2: 1 (start not kept); of 20 each), "
        "1.5 CPU-hours, in "
    )
    assert line.endswith("vapo_length_adaptive.jsonl")
    # A run of the arm's older config (recorded beside the new ones) is not the claim's run
    # now: the sweep has it to train.
    book.add(arm, 2, 4, "c", "older", _run(cpu_s=3600.0))
    line = recorded_runs(claim, book, lambda arm, start, seed: "k")
    assert line.startswith("2 of 40 runs (start 1: 1 (start not kept), start 2: 1 (start not")
    # Where the repository keeps a start, only its records count: another start's are
    # runs a sweep from the kept start trains again.
    for start, identity in ((1, "b"), (2, "e")):
        path = starts.start_path("testbed_long", start)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        np.savez(
            path, __meta__=np.array(json.dumps({"step": 1000, "meta": {}, "start_id": identity}))
        )
    line = recorded_runs(claim, book, lambda arm, start, seed: "k")
    assert line.startswith(
        "1 of 40 runs (start 1: 1 (+1 of another start), start 2: 0 (+1 of another start); "
        "of 20 each), 0.5 CPU-hours"
    )
    # In --list, the key of the config the claim's sweep would train.
    keys = []
    monkeypatch.setattr(reproduce, "recorded_runs", lambda c, b, key_of: keys.append(key_of))
    reproduce._list()
    (first, *_) = keys
    routing = get_claim(next(iter(reproduce.CLAIMS)))
    config = ablate.arm_config(
        routing.ablation,
        routing.arm_labels()[0],
        0,
        routing.regime,
        lambda c: reproduce.SETTINGS[routing.setting](c, "runs/x/checkpoints"),
    )
    assert first(routing.arm_labels()[0], 0, 0) == ablate.run_config_key(config)


def _summary_code() -> str:
    import hashlib  # noqa: PLC0415
    import inspect  # noqa: PLC0415

    parts = [inspect.getsource(ablate.summarise_run), inspect.getsource(ablate.collapse_iteration)]
    parts += [
        repr(x)
        for x in (
            ablate.TAIL_METRICS,
            ablate.POLICY_MEAN_METRICS,
            ablate.WARMUP_EXPLAINED_VARIANCE,
            ablate.COLLAPSE_FRACTION,
        )
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def test_a_change_to_the_summarys_code_asks_for_its_version(monkeypatch):
    """A record holds summarise_run's figures as they were computed: when the code that
    computes them changes, this trips. If a figure's meaning changed, bump
    ablate.SUMMARY_VERSION (the old records stop counting); either way, update the digest."""
    assert (ablate.SUMMARY_VERSION, _summary_code()) == (1, "6656d5bca9259da3")
    # The version is part of every key: a record of another version is another config.
    config = testbed_long.get_config()
    assert ablate.run_config_key(config) == ablate.run_config_key(config, tail=5)
    assert ablate.run_config_key(config, tail=3) != ablate.run_config_key(config)
    before = ablate.run_config_key(config)
    monkeypatch.setattr(ablate, "SUMMARY_VERSION", 2)
    assert ablate.run_config_key(config) != before


def test_the_repositorys_recorded_runs_are_found_by_the_current_configs():
    """Every run kept in docs/claims/runs is the run its claim would train now: its arm's
    config key, built from the current recipes and claim definitions, is the one recorded.
    A change that moves keys (e.g. a config field added without its earlier value in
    ``ledger.LATER_FIELDS``) would make every sweep train its recorded runs again."""
    from configs.claims import CLAIMS
    from experiments.reproduce import claim_dir, claim_run_key

    names = {
        os.path.basename(claim_dir("", claim, setting)): (claim, setting)
        for claim in CLAIMS.values()
        for setting in claim.settings()
    }
    files = sorted(f for f in os.listdir(ledger.LEDGER_DIR) if f.endswith(".jsonl"))
    assert files  # the repository keeps some
    for name in files:
        claim, setting = names[name[: -len(".jsonl")]]
        for record in Ledger(os.path.join(ledger.LEDGER_DIR, name)).records:
            key = claim_run_key(
                claim,
                setting,
                claim.regime,
                record["arm"],
                int(record["start"]),
                int(record["seed"]),
            )
            assert key == record["config"], (name, record["arm"], record["start"], record["seed"])
