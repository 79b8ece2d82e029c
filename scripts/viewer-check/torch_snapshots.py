"""Writes torch's own snapshots (torch.cuda.memory._dump_snapshot) under
Quilt, one per scenario, for the viewer check, on the project's simulated GPU.

    PYTHON scripts/viewer-check/torch_snapshots.py OUT_DIR [SCENARIO...]

PYTHON is the torch venv's (scripts/torch-venv.sh). Each scenario runs in a
process of its own through scripts/simulated-gpu.sh (two devices of 2 GiB;
`cargo build --release` first), with quilt_torch.enable() and
QUILT_ALLOC_CONF=backend:cuda (and reclaim:always where named); torch
records its history (_record_memory_history), the scenario churns tensors,
and torch writes OUT_DIR/SCENARIO.pickle. Prints the paths.
"""

import os
import random
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "python"))

MiB = 1 << 20

# name: (QUILT_ALLOC_CONF, streams, options)
SCENARIOS = {
    "torch-one-stream": ("backend:cuda", 1, {"empty_cache": True}),
    "torch-one-stream-reclaim-always": ("backend:cuda,reclaim:always", 1, {}),
    "torch-two-streams": ("backend:cuda", 2, {"empty_cache": True}),
    "torch-two-streams-reclaim-always": ("backend:cuda,reclaim:always", 2, {"empty_cache": True}),
    "torch-oom": ("backend:cuda", 1, {"oom": True, "empty_cache": True}),
    "torch-two-devices": ("backend:cuda,reclaim:always", 1, {"devices": 2}),
    "torch-sleep-wake": ("backend:cuda", 1, {"sleep": True}),
}


def fail(message):
    raise SystemExit("torch_snapshots: " + message)


def scenario(name, path):
    import torch
    import quilt_torch

    quilt_torch.enable()
    _, streams, opts = SCENARIOS[name]
    rng = random.Random(name)
    devices = opts.get("devices", 1)
    if torch.cuda.device_count() < devices:
        fail("{} devices wanted, torch sees {}".format(devices, torch.cuda.device_count()))
    side = [torch.cuda.Stream(device=d) for d in range(devices) for _ in range(streams - 1)]
    weights = None
    if opts.get("sleep"):
        with quilt_torch.tag("weights"):
            weights = [torch.empty((i + 2) * MiB, dtype=torch.uint8, device="cuda") for i in range(4)]
    torch.cuda.memory._record_memory_history(max_entries=100000)
    live = []
    for step in range(120):
        device = step % devices
        if opts.get("sleep") and step == 40:
            quilt_torch.sleep("weights")
        if opts.get("sleep") and step == 80:
            quilt_torch.wake("weights")
        size = rng.choice((1, 2, 3, 5, 8, 13, 30)) * MiB + rng.randrange(4) * 512
        if live and (rng.random() < 0.45 or len(live) > 12):
            del live[rng.randrange(len(live))]
        else:
            choice = rng.randrange(streams)
            with torch.cuda.device(device):
                stream = torch.cuda.current_stream(device) if choice == 0 else side[device * (streams - 1) + choice - 1]
                with torch.cuda.stream(stream):
                    live.append(torch.empty(size, dtype=torch.uint8, device="cuda:{}".format(device)))
        if opts.get("empty_cache") and step % 30 == 29:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        if opts.get("oom") and step == 60:
            try:
                torch.empty(64 << 30, dtype=torch.uint8, device="cuda")
                fail("64 GiB served")
            except torch.OutOfMemoryError:
                pass
    del live[::2]
    for d in range(devices):
        torch.cuda.synchronize(d)
    if opts.get("empty_cache"):
        torch.cuda.empty_cache()
    torch.cuda.memory._dump_snapshot(path)
    del weights


def main():
    if len(sys.argv) >= 4 and sys.argv[1] == "--worker":
        scenario(sys.argv[2], sys.argv[3])
        return
    if len(sys.argv) < 2:
        fail("usage: torch_snapshots.py OUT_DIR [SCENARIO...]")
    out = sys.argv[1]
    names = sys.argv[2:] or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        fail("no scenario {} (known: {})".format(", ".join(unknown), ", ".join(SCENARIOS)))
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("QUILT_CUDA_DOUBLE_MEMORY", "2GiB")
    env.setdefault("QUILT_CUDA_DOUBLE_DEVICES", "2")
    for name in names:
        path = os.path.join(out, name + ".pickle")
        env["QUILT_ALLOC_CONF"] = SCENARIOS[name][0]
        done = subprocess.run(
            [os.path.join(REPO, "scripts", "simulated-gpu.sh"), sys.executable, os.path.abspath(__file__), "--worker", name, path],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            universal_newlines=True,
            timeout=600,
        )
        if done.returncode != 0:
            fail("{} failed ({}):\n{}".format(name, done.returncode, done.stdout[-4000:]))
        print(path)


if __name__ == "__main__":
    main()
