"""Fault drills against the CPU job: a stalled worker, a killed worker, a killed launcher and a
torn checkpoint; after each, resume from the last complete checkpoint and compare the losses.

    python scripts/fault_drill.py                            # every drill, 4 workers, T = 5 s
    python scripts/fault_drill.py --drills stall,kill-worker --timeout 5 --json drill.json
    python scripts/fault_drill.py --drills torn-checkpoint --nproc 2 --steps 5 --fault-at 2

Every drill starts ``zeppelin train`` (2 emulated nodes x 2 GPUs, a checkpoint every step,
``--zeppelin-comm-timeout-s T``; the reference and resumed runs keep the job's default), waits
for a checkpoint of step ``--fault-at``, injects its fault from outside and records what the job
did: the exit status, its error lines, seconds from the fault until every worker is gone and
until the launcher has exited too. Then it resumes from the last complete checkpoint to
``--steps`` and compares each resumed step's loss with an uninterrupted reference run of the
same flags (``max |loss - reference|``; 0 means the same).

* ``stall``: SIGSTOP rank 2. Expected: every worker gone within 2 T and exit 1; the first line
  names rank 2, another the step and layer it stopped at.
* ``kill-worker``: SIGKILL rank 1. Expected: exit 1; one line naming rank 1 and the signal; no
  traceback on the terminal.
* ``kill-launcher``: SIGKILL the launcher. Expected: every worker gone within seconds.
* ``torn-checkpoint``: what a kill during a save leaves (a newer step directory, one rank file
  cut short, no manifest) next to the last complete checkpoint. Expected: the resume loads the
  complete one; and ``--load`` of a checkpoint with a cut-short file refuses before launch,
  naming the file (exit 2).

Prints a table (drill, expected, observed, ok) and exits 1 if any drill failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

from megatron_zeppelin import checkpoint

DRILLS = ("stall", "kill-worker", "kill-launcher", "torn-checkpoint")
WAIT_S = 900.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", default="runs/drill", help="Data, checkpoints and logs.")
    parser.add_argument("--drills", default=",".join(DRILLS), help="Comma-separated drills.")
    parser.add_argument("--steps", type=int, default=12, help="Steps of every run.")
    parser.add_argument("--fault-at", type=int, default=3, help="Checkpoint to wait for.")
    parser.add_argument("--timeout", type=float, default=5.0, help="--zeppelin-comm-timeout-s.")
    parser.add_argument("--json", default=None, help="Write the results here.")
    parser.add_argument("--nproc", type=int, default=4, help="Workers (2 nodes of nproc / 2).")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.drills.split(",")) - set(DRILLS))
    if unknown:
        parser.error(f"unknown drills {unknown}; choose from {', '.join(DRILLS)}")
    if args.nproc < 2 or args.nproc % 2:
        parser.error("--nproc must be an even number of workers, at least 2 (two nodes)")
    if args.nproc < 3 and {"stall", "kill-worker"} & set(args.drills.split(",")):
        parser.error("the stall and kill-worker drills need --nproc 4 or more (they stop rank 2)")
    if not 1 <= args.fault_at < args.steps:
        parser.error("--fault-at must be at least 1 and below --steps")
    return args


# --- running the job ---------------------------------------------------------------------------
def train_command(args: argparse.Namespace, *flags: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "megatron_zeppelin.cli",
        "train",
        "--run-dir",
        args.run_dir,
        "--quiet",
        "--steps",
        str(args.steps),
        "--nproc",
        str(args.nproc),
        *flags,
    ]


def last_rank_file(args: argparse.Namespace) -> str:
    """The rank file the torn-checkpoint drill cuts short: the last rank's."""
    return f"rank{args.nproc - 1:03d}.pt"


def start(args: argparse.Namespace, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        train_command(args, *flags),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def run(args: argparse.Namespace, *flags: str) -> tuple[int, str]:
    done = subprocess.run(
        train_command(args, *flags), capture_output=True, text=True, timeout=WAIT_S
    )
    return done.returncode, done.stderr


def losses(path: str) -> dict[int, float]:
    with open(path) as f:
        return {r["step"]: r["loss"] for r in json.load(f)["steps"]}


def workers(launcher: int) -> dict[int, int]:
    """Rank -> pid of the launcher's workers (from each one's RANK variable)."""
    with open(f"/proc/{launcher}/task/{launcher}/children") as f:
        pids = [int(p) for p in f.read().split()]
    found = {}
    for pid in pids:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        found[int(env[b"RANK"])] = pid
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def wait_for_checkpoint(root: str, step: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            if checkpoint.verify(checkpoint.resolve(root)).step >= step:
                return
        except ValueError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the job ended before step {step}: {proc.communicate()[1]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no checkpoint of step {step} within {WAIT_S:.0f} s")
        time.sleep(0.1)


def wait_gone(pids: list[int], proc: subprocess.Popen, since: float) -> tuple[float, float]:
    """Seconds from ``since`` until every worker is gone, and until the launcher is too."""
    deadline = time.monotonic() + WAIT_S
    workers_s = None
    while workers_s is None or proc.poll() is None:
        if workers_s is None and not any(alive(p) for p in pids):
            workers_s = time.monotonic() - since
        if time.monotonic() > deadline:
            raise RuntimeError("processes still running long after the fault")
        time.sleep(0.05)
    return workers_s, time.monotonic() - since


# --- the drills --------------------------------------------------------------------------------
def fault_drill(args: argparse.Namespace, name: str, root: str) -> dict:
    """Start the job, inject ``name``'s fault, record what happened."""
    proc = start(
        args, "--save", root, "--save-every", "1", "--zeppelin-comm-timeout-s", str(args.timeout)
    )
    wait_for_checkpoint(root, args.fault_at, proc)
    ranks = workers(proc.pid)
    t0 = time.monotonic()
    if name == "stall":
        os.kill(ranks[2], signal.SIGSTOP)
    elif name == "kill-worker":
        os.kill(ranks[1], signal.SIGKILL)
    else:
        os.kill(proc.pid, signal.SIGKILL)
    workers_s, seconds = wait_gone(list(ranks.values()), proc, t0)
    err = proc.communicate()[1]
    lines = err.strip().splitlines()
    return {
        "exit": proc.returncode,
        "seconds": seconds,
        "workers_s": workers_s,
        "lines": lines,
        "traceback_on_terminal": "Traceback" in err,
    }


def torn_drill(args: argparse.Namespace, root: str) -> dict:
    """Leave what a kill during a save leaves, then try a checkpoint with a cut-short file."""
    proc = start(args, "--save", root, "--save-every", "1")
    wait_for_checkpoint(root, args.fault_at, proc)
    os.kill(proc.pid, signal.SIGTERM)  # stop it (as Ctrl-C would); what it left on disk counts
    proc.communicate()
    good = checkpoint.resolve(root)
    step = checkpoint.verify(good).step
    torn = checkpoint.step_directory(root, step + 1)
    shutil.rmtree(torn, ignore_errors=True)  # the interrupted run may have begun that save
    shutil.copytree(good, torn)
    os.remove(os.path.join(torn, checkpoint.MANIFEST))
    with open(os.path.join(torn, "rank001.pt"), "r+b") as f:
        f.truncate(os.path.getsize(f.name) // 2)
    broken = root + "-broken"
    shutil.copytree(good, broken)
    with open(os.path.join(broken, last_rank_file(args)), "r+b") as f:
        f.truncate(os.path.getsize(f.name) // 2)
    code, err = run(args, "--load", broken)
    shutil.rmtree(broken)
    return {
        "exit": code,
        "lines": err.strip().splitlines(),
        "resumes_from": step,
        "cut_short": last_rank_file(args),
    }


def resume(args: argparse.Namespace, root: str, reference: dict[int, float], tag: str) -> dict:
    """Resume from the last complete checkpoint to --steps; the losses against the reference."""
    start_step = checkpoint.verify(checkpoint.resolve(root)).step
    out = os.path.join(args.run_dir, f"{tag}-resumed.json")
    code, err = run(args, "--load", root, "--json", out)
    if code != 0 or not os.path.exists(out):
        return {"from": start_step, "exit": code or 1, "error": err.strip() or "no steps run"}
    resumed = losses(out)
    diff = max(abs(loss - reference[step]) for step, loss in resumed.items())
    return {"from": start_step, "exit": 0, "steps": len(resumed), "max_loss_diff": diff}


def verdict(name: str, fault: dict, resumed: dict, timeout: float) -> tuple[str, str, bool]:
    """(expected, observed, ok) of one drill."""
    lines = fault.get("lines", [])
    first = lines[0] if lines else ""
    same = resumed.get("exit") == 0 and resumed.get("max_loss_diff") == 0.0
    after = f"resumed from step {resumed.get('from')}: " + (
        f"{resumed['steps']} steps, max |loss diff| {resumed['max_loss_diff']:g}"
        if resumed.get("exit") == 0
        else f"FAILED ({resumed.get('error')})"
    )
    if name == "stall":
        where = any("last seen at step" in line for line in lines)
        named = "rank 2 stopped responding" in first and where
        ok = fault["exit"] == 1 and named and fault["workers_s"] <= 2 * timeout and same
        expected = f"job over within 2T ({2 * timeout:g} s), rank 2 named with step and layer"
        observed = f"{_ends(fault)}: {_short(lines)}"
    elif name == "kill-worker":
        ok = (
            fault["exit"] == 1
            and "rank 1 was killed by SIGKILL" in first
            and not fault["traceback_on_terminal"]
            and same
        )
        expected = "exit 1, one line naming rank 1 and SIGKILL, no traceback"
        observed = f"{_ends(fault)}: {_short(lines)}"
    elif name == "kill-launcher":
        ok = fault["workers_s"] < 10 and same
        expected = "every worker gone within seconds"
        observed = f"all workers gone {fault['workers_s']:.1f} s after the kill"
    else:
        ok = fault["exit"] == 2 and f"{fault['cut_short']} has" in first and same
        expected = "a torn save is skipped; a cut-short file is refused before launch (exit 2)"
        observed = f"--load of the damaged copy: exit {fault['exit']}: {_short(lines)}"
    return expected, f"{observed}; {after}", ok


def _ends(fault: dict) -> str:
    return (
        f"workers gone after {fault['workers_s']:.1f} s, exit {fault['exit']} after "
        f"{fault['seconds']:.1f} s"
    )


def _short(lines: list[str]) -> str:
    text = " | ".join(line.replace("zeppelin train: error: ", "") for line in lines[:2])
    return text if len(text) < 400 else text[:400] + "..."


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.run_dir, exist_ok=True)
    ref_json = os.path.join(args.run_dir, "reference.json")
    code, err = run(args, "--json", ref_json)
    if code != 0:
        print(f"the reference run failed: {err}", file=sys.stderr)
        return 1
    reference = losses(ref_json)
    rows = []
    for name in args.drills.split(","):
        root = os.path.join(args.run_dir, f"ckpt-{name}")
        shutil.rmtree(root, ignore_errors=True)
        if name == "torn-checkpoint":
            fault = torn_drill(args, root)
        else:
            fault = fault_drill(args, name, root)
        resumed = resume(args, root, reference, name)
        expected, observed, ok = verdict(name, fault, resumed, args.timeout)
        rows.append(
            {
                "drill": name,
                "expected": expected,
                "observed": observed,
                "ok": ok,
                "fault": fault,
                "resume": resumed,
            }
        )
        print(f"{name}: {'ok' if ok else 'FAILED'}", file=sys.stderr, flush=True)
    print(f"{'drill':<16} {'ok':<3} expected / observed")
    for row in rows:
        print(f"{row['drill']:<16} {'yes' if row['ok'] else 'NO':<3} {row['expected']}")
        print(f"{'':<20} {row['observed']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"timeout_s": args.timeout, "steps": args.steps, "drills": rows}, f, indent=1)
    return 0 if all(row["ok"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
