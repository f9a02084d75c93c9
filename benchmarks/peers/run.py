"""One GRPO iteration of the same model and batch in policyopt, tunix and TRL, side by side.

    python3 benchmarks/peers/run.py                 # build what is missing, 2 rounds, table
    python3 benchmarks/peers/run.py --rounds 3      # add a third round to the same results

Builds one virtual environment per side under ``.peers-venvs/`` (repository root) from
the pinned ``requirements/<side>.txt`` (again when it changes), then runs the sides' scripts in
interleaved rounds, each in its own process, recording the load (``/proc/loadavg``) while
each runs. Every finished run is written to the JSON at once, so an interrupted command
resumes where it stopped; ``--fresh`` starts over. Standard library only: any Python 3.11
runs it. See ``benchmarks/peers/README.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SIDES = ("policyopt", "tunix", "trl")
# Outside every package directory, so that nothing walking the sources (tests, linters)
# reads the environments' site-packages; ignored by git.
VENVS = REPO / ".peers-venvs"
DEFAULT_OUT = REPO / "benchmarks" / "results" / "peers.json"
COLUMNS = (
    ("iteration_s", "s / iteration"),
    ("generate_s", "generate"),
    ("update_s", "update"),
    ("first_iteration_s", "first iteration"),
)
# The same phases in process CPU seconds (every thread of the side's process).
CPU_COLUMNS = tuple((key.replace("_s", "_cpu_s"), title) for key, title in COLUMNS)


def log(message: str) -> None:
    print(f"[peers {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def requirements_digest(side: str) -> str:
    text = (HERE / "requirements" / f"{side}.txt").read_bytes()
    return hashlib.sha256(text).hexdigest()[:16]


def venv_python(side: str) -> Path:
    return VENVS / side / "bin" / "python"


def build(side: str, python: str) -> None:
    """Creates ``.peers-venvs/<side>`` from ``requirements/<side>.txt`` unless it is already
    built from that file (a marker holds the file's digest)."""
    venv = VENVS / side
    marker = venv / ".built"
    digest = requirements_digest(side)
    if marker.exists() and marker.read_text().strip() == digest:
        return
    log(f"building the {side} environment in {venv} (a few minutes)")
    if venv.exists():
        shutil.rmtree(venv)
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    pip = [str(venv_python(side)), "-m", "pip", "install", "--quiet"]
    subprocess.run(pip + ["--upgrade", "pip"], check=True)
    requirements = HERE / "requirements" / f"{side}.txt"
    if side == "policyopt":
        # The working tree itself, editable, its dependencies held at the pinned versions.
        command = pip + ["-c", str(requirements), "-e", str(REPO)]
    else:
        command = pip + ["-r", str(requirements)]
    subprocess.run(command, check=True)
    marker.write_text(digest + "\n")


def side_env(side: str, omp_passive: bool = False) -> dict:
    env = dict(os.environ)
    if omp_passive:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    env.update(
        JAX_PLATFORMS="cpu",
        TF_CPP_MIN_LOG_LEVEL="3",
        # The first iteration's time includes compiling: no persistent cache.
        JAX_ENABLE_COMPILATION_CACHE="false",
        CUDA_VISIBLE_DEVICES="",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        WANDB_DISABLED="true",
        PYTHONUNBUFFERED="1",
    )
    if side == "policyopt":
        env["PYTHONPATH"] = str(REPO)
    return env


class LoadSampler:
    """Reads ``/proc/loadavg`` every ``period`` seconds while a run lasts."""

    def __init__(self, period: float = 1.0):
        self.period = period
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _read(self) -> float | None:
        try:
            return float(Path("/proc/loadavg").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def _loop(self) -> None:
        while not self._stop.is_set():
            value = self._read()
            if value is not None:
                self.samples.append(value)
            self._stop.wait(self.period)

    def __enter__(self) -> "LoadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        if not self.samples:
            return {}
        return {
            "loadavg_1min_min": min(self.samples),
            "loadavg_1min_mean": statistics.fmean(self.samples),
            "loadavg_1min_max": max(self.samples),
            "samples": len(self.samples),
        }


def run_side(side: str, args) -> dict:
    """One run of ``side_<side>.py`` in its environment: its JSON, plus load and CPU time."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [
            str(venv_python(side)),
            str(HERE / f"side_{side}.py"),
            "--iterations",
            str(args.iterations),
            "--warmup",
            str(args.warmup),
            "--old_log_probs",
            args.old_log_probs,
            "--json",
            str(out),
        ]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        with LoadSampler() as load:
            proc = subprocess.run(
                command,
                env=side_env(side, args.omp_passive),
                cwd=tmp,
                capture_output=True,
                text=True,
            )
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stdout + proc.stderr)[-4000:]
            raise RuntimeError(f"the {side} side failed (exit {proc.returncode}):\n{tail}")
        result = json.loads(out.read_text())
    result["load"] = load.summary()
    result["process_wall_s"] = wall
    result["process_cpu_s"] = (after.ru_utime - before.ru_utime) + (
        after.ru_stime - before.ru_stime
    )
    return result


def machine() -> dict:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": model or platform.processor(),
        "cores": os.cpu_count(),
        "platform": platform.platform(),
    }


def settings(args) -> dict:
    """What makes runs comparable: a results file mixes only runs with equal settings."""
    return {
        "iterations": args.iterations,
        "warmup": args.warmup,
        "old_log_probs": args.old_log_probs,
        # Only when set, so that results written before the option still resume.
        **({"omp_passive": True} if args.omp_passive else {}),
        "requirements": {side: requirements_digest(side) for side in args.sides},
    }


def load_results(path: Path, args) -> dict:
    fresh = {"settings": settings(args), "machine": machine(), "runs": []}
    if args.fresh or not path.exists():
        return fresh
    results = json.loads(path.read_text())
    if results.get("settings") != fresh["settings"]:
        raise SystemExit(
            f"{path} holds runs with other settings ({results.get('settings')}); "
            "pass --fresh to start over or --out to write elsewhere"
        )
    return results


def save(path: Path, results: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


def summarise(results: dict, sides) -> dict:
    """Per side: the median over rounds of each run's medians, and their range."""
    table = {}
    for side in sides:
        runs = [r for r in results["runs"] if r["side"] == side]
        if not runs:
            continue
        row = {"runs": len(runs)}
        for key, _ in COLUMNS + CPU_COLUMNS:
            values = [r["median"].get(key, r.get(key)) for r in runs]
            values = [v for v in values if v is not None]  # runs from before CPU times
            if not values:
                continue
            row[key] = {
                "median": statistics.median(values),
                "min": min(values),
                "max": max(values),
            }
        spans = [r["compilation"][1] for r in runs if len(r.get("compilation", [])) > 1]
        if spans:  # JAX sides: what the first iteration compiled
            row["first_iteration_compilation"] = {
                key: statistics.median(span[key] for span in spans)
                for key in ("programs", "trace_s", "lower_s", "xla_compile_s")
            }
        loads = [r["load"].get("loadavg_1min_mean") for r in runs if r.get("load")]
        row["loadavg_1min_mean"] = statistics.fmean(loads) if loads else None
        table[side] = row
    return table


def print_table(table: dict, results: dict) -> None:
    info = results["machine"]
    for columns, unit in ((COLUMNS, "wall seconds"), (CPU_COLUMNS, "process CPU seconds")):
        if not any(columns[0][0] in row for row in table.values()):
            continue
        print(
            f"\nOne GRPO iteration, {info['cpu']} ({info['cores']} cores); {unit}, "
            f"median over rounds of each run's median (range over rounds)"
        )
        header = f"{'side':<12}" + "".join(f"{title:>22}" for _, title in columns)
        print(header + f"{'load':>7}")
        for side, row in table.items():
            cells = []
            for key, _ in columns:
                cell = row.get(key)
                text = "-" if cell is None else f"{cell['median']:.2f}"
                if cell is not None and row["runs"] > 1:
                    text += f" ({cell['min']:.2f}-{cell['max']:.2f})"
                cells.append(f"{text:>22}")
            load = row["loadavg_1min_mean"]
            print(f"{side:<12}" + "".join(cells) + (f"{load:>7.1f}" if load is not None else ""))
    for side, row in table.items():
        span = row.get("first_iteration_compilation")
        if span:
            print(
                f"{side}: the first iteration compiled {span['programs']:.0f} programs: "
                f"tracing {span['trace_s']:.1f} s, lowering {span['lower_s']:.1f} s, "
                f"XLA {span['xla_compile_s']:.1f} s"
            )
    if "policyopt" in table:
        ours = table["policyopt"]
        for side in table:
            if side == "policyopt":
                continue
            for columns, unit in ((COLUMNS, "wall"), (CPU_COLUMNS, "CPU")):
                ratios = ", ".join(
                    f"{title} {table[side][key]['median'] / ours[key]['median']:.2f}x"
                    for key, title in columns
                    if key in table[side] and key in ours
                )
                if ratios:
                    print(f"{side} / policyopt, {unit}: {ratios}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds to complete")
    parser.add_argument("--sides", default=",".join(SIDES), help="comma-separated sides")
    parser.add_argument("--iterations", type=int, default=5, help="measured iterations a run")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up iterations a run")
    parser.add_argument(
        "--old_log_probs",
        choices=("sampler", "trainer"),
        default="sampler",
        help="pi_old from the sampler's log-probs, or from a forward pass of the trainer",
    )
    parser.add_argument(
        "--omp_passive",
        action="store_true",
        help="OMP_WAIT_POLICY=PASSIVE for every side: OpenMP threads (torch's) sleep at once "
        "instead of spinning at each parallel region's barrier, which on a loaded machine "
        "burns CPU time (and wall time) that measures the load, not the work",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON")
    parser.add_argument("--fresh", action="store_true", help="discard the runs in --out")
    parser.add_argument("--build_only", action="store_true", help="build the environments")
    parser.add_argument(
        "--python", default=sys.executable, help="the Python (3.11) the environments are made with"
    )
    args = parser.parse_args(argv)
    args.sides = tuple(s for s in args.sides.split(",") if s)
    unknown = sorted(set(args.sides) - set(SIDES))
    if unknown:
        parser.error(f"unknown side(s) {unknown}; expected some of {list(SIDES)}")
    for side in args.sides:
        build(side, args.python)
    if args.build_only:
        return
    results = load_results(args.out, args)
    save(args.out, results)
    for round_index in range(args.rounds):
        # Each round starts with another side, so no side always runs first or last.
        shift = round_index % len(args.sides)
        order = args.sides[shift:] + args.sides[:shift]
        for side in order:
            if any(r["round"] == round_index and r["side"] == side for r in results["runs"]):
                continue
            log(f"round {round_index + 1}/{args.rounds}: {side}")
            run = run_side(side, args)
            run.update(round=round_index, side=side, finished=time.strftime("%Y-%m-%d %H:%M:%S"))
            results["runs"].append(run)
            save(args.out, results)
            med = run["median"]
            log(
                f"{side}: {med['iteration_s']:.2f} s / iteration (generate "
                f"{med['generate_s']:.2f}, update {med['update_s']:.2f}), first "
                f"{run['first_iteration_s']:.1f} s; CPU {med['iteration_cpu_s']:.2f} s / "
                f"iteration (generate {med['generate_cpu_s']:.2f}, update "
                f"{med['update_cpu_s']:.2f}), first {run['first_iteration_cpu_s']:.1f} s; "
                f"load {run['load'].get('loadavg_1min_mean', 0):.1f}"
            )
    results["table"] = summarise(results, args.sides)
    save(args.out, results)
    print_table(results["table"], results)
    print(f"\nwritten: {args.out}")


if __name__ == "__main__":
    main()
