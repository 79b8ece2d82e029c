"""Writes Quilt snapshots with history, one per scenario, for the viewer check.

    python3 scripts/viewer-check/make_snapshots.py OUT_DIR [SCENARIO...]

Each scenario runs in a process of its own (the library reads
QUILT_ALLOC_CONF once per process) through quilt_torch's ctypes binding of
libquilt_torch.so (QUILT_TORCH_LIBRARY, else target/release), on the host
backend, with no torch needed; it records the history, churns, and writes
OUT_DIR/SCENARIO.pickle with quilt_torch.dump_snapshot. Prints the paths.
"""

import os
import random
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "python"))

MiB = 1 << 20
HOST = "backend:host,capacity:256MiB"
STREAMS = (0, 0x1111, 0x2222, 0x3333)

# name: (QUILT_ALLOC_CONF, streams, options)
SCENARIOS = {
    "empty": (HOST, (0,), {"churn": 0}),
    "one-stream-churn": (HOST, (0,), {}),
    "one-stream-churn-empty-cache": (HOST, (0,), {"empty_cache": True}),
    "one-stream-reclaim-always": (HOST + ",reclaim:always", (0,), {}),
    "one-stream-reclaim-always-empty-cache": (HOST + ",reclaim:always", (0,), {"empty_cache": True}),
    "streams-churn": (HOST, STREAMS, {}),
    "streams-churn-empty-cache": (HOST, STREAMS, {"empty_cache": True}),
    "streams-reclaim-always": (HOST + ",reclaim:always", STREAMS, {"empty_cache": True}),
    "one-stream-oom": (HOST, (0,), {"oom": True, "empty_cache": True}),
    "streams-oom-reclaim-always": (HOST + ",reclaim:always", STREAMS, {"oom": True}),
    "two-devices": (HOST, (0, 0x1111), {"devices": (0, 1), "empty_cache": True}),
    "two-devices-one-stream": (HOST + ",reclaim:always", (0,), {"devices": (0, 1)}),
    "history-trimmed": (HOST, STREAMS, {"max_entries": 60, "empty_cache": True}),
    "recording-starts-late": (HOST, STREAMS, {"before": 12, "empty_cache": True}),
    "one-stream-recording-starts-late": (HOST + ",reclaim:always", (0,), {"before": 12}),
    "sleep-wake": (HOST, (0,), {"sleep": True}),
    "streams-sleep-wake": (HOST, STREAMS, {"sleep": True, "empty_cache": True}),
    "recording-stopped": (HOST, STREAMS, {"stop": 100, "empty_cache": True}),
    "one-stream-recording-stopped": (HOST + ",reclaim:always", (0,), {"stop": 100}),
}


def fail(message):
    raise SystemExit("make_snapshots: " + message)


def scenario(name, path):
    import quilt_torch as qt

    conf, streams, opts = SCENARIOS[name]
    lib = qt._library()
    rng = random.Random(name)
    devices = opts.get("devices", (0,))
    live = []

    def malloc(size, device, stream):
        p = lib.quilt_malloc(size, device, stream)
        if not p:
            fail("{}: quilt_malloc({}) failed: {}".format(name, size, qt.last_error()))
        live.append((p, size, device, stream))

    def free_one():
        p, size, device, stream = live.pop(rng.randrange(len(live)))
        lib.quilt_free(p, size, device, stream)

    for step in range(opts.get("before", 0)):
        # Allocated before recording starts: live in the snapshot, absent
        # from the history.
        malloc((step % 4 + 1) * MiB, devices[0], streams[step % len(streams)])
        if step % 3 == 2:
            free_one()
    if opts.get("sleep"):
        with qt.tag("weights"):
            for i in range(6):
                malloc((i + 2) * MiB, devices[0], streams[0])
        weights = live[:]
        del live[:]
    qt.record_history(True, opts.get("max_entries", 100000))
    for step in range(opts.get("churn", 160)):
        if opts.get("stop") == step:
            # Recording stops; what was recorded is kept (and dumped).
            qt.record_history(False, 0)
        if opts.get("sleep") and step == 50:
            qt.sleep("weights")
        if opts.get("sleep") and step == 110:
            qt.wake("weights")
        device = devices[step % len(devices)]
        stream = streams[rng.randrange(len(streams))]
        size = rng.choice((1, 2, 3, 5, 8, 13, 30)) * MiB + rng.randrange(4) * 4096
        if live and (rng.random() < 0.45 or sum(s for _, s, _, _ in live) > 150 * MiB):
            free_one()
        else:
            malloc(size, device, stream)
        if opts.get("empty_cache") and step % 40 == 39:
            qt.empty_cache()
        if opts.get("oom") and step == 80:
            if lib.quilt_malloc(300 * MiB, devices[0], streams[0]):
                fail("300 MiB of 256 served")
    for _ in range(len(live) // 2):
        free_one()
    if opts.get("empty_cache"):
        qt.empty_cache()
    qt.dump_snapshot(path)


def main():
    if len(sys.argv) >= 4 and sys.argv[1] == "--worker":
        scenario(sys.argv[2], sys.argv[3])
        return
    if len(sys.argv) < 2:
        fail("usage: make_snapshots.py OUT_DIR [SCENARIO...]")
    out = sys.argv[1]
    names = sys.argv[2:] or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        fail("no scenario {} (known: {})".format(", ".join(unknown), ", ".join(SCENARIOS)))
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("QUILT_TORCH_LIBRARY", os.path.join(REPO, "target", "release", "libquilt_torch.so"))
    for name in names:
        path = os.path.join(out, name + ".pickle")
        env["QUILT_ALLOC_CONF"] = SCENARIOS[name][0]
        done = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--worker", name, path],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            universal_newlines=True,
        )
        if done.returncode != 0:
            fail("{} failed ({}):\n{}".format(name, done.returncode, done.stdout))
        print(path)


if __name__ == "__main__":
    main()
