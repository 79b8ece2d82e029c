"""Each program of benches/programs parses its arguments, refuses bad ones,
and runs to its summary line on the CPU with tiny settings.

Run with the python of scripts/torch-venv.sh's environment (torch and
transformers); benches/tests/programs.rs does, from `cargo test`::

    ~/.cache/quilt/torch-venv/bin/python -m unittest discover -s benches/programs/tests -v

The programs run in this process (runpy, as `__main__`), one after another,
so torch and transformers are imported once. What this does not check is
the simulated GPU: `quilt-bench live` runs the programs there.
"""

import contextlib
import io
import os
import runpy
import sys
import unittest

PROGRAMS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Tiny settings: a few seconds each on two cores.
TINY = {
    "gpt2_train": ["--steps", "2", "--batch", "2", "--min-len", "16", "--max-len", "48", "--layers", "1",
                   "--embd", "64", "--heads", "2", "--vocab", "512"],
    "bert_finetune": ["--steps", "2", "--batch", "4", "--median-len", "16", "--max-len", "64", "--layers", "1",
                      "--hidden", "64", "--heads", "2"],
    "llama_generate": ["--rounds", "2", "--max-prompt", "32", "--new-tokens", "3", "--hidden", "64",
                       "--layers", "1", "--heads", "4", "--kv-heads", "2", "--mlp", "128", "--vocab", "512",
                       "--dtype", "float32"],
    "vit_train": ["--steps", "1", "--batch", "2", "--last-batch", "1", "--image", "32", "--patch", "8",
                  "--layers", "1", "--hidden", "64", "--heads", "2", "--amp", "none"],
    "model_switch": ["--rounds", "1", "--max-prompt", "32", "--new-tokens", "2", "--first-hidden", "64",
                     "--first-mlp", "128", "--second-hidden", "128", "--second-mlp", "256", "--layers", "1",
                     "--head-dim", "16", "--kv-groups", "2", "--vocab", "512", "--dtype", "float32"],
    "ddp_gloo": ["--steps", "2", "--batch", "2", "--min-len", "16", "--max-len", "32", "--layers", "1",
                 "--embd", "64", "--heads", "2", "--vocab", "512"],
}

# One argument each program must refuse, with argparse's exit status 2.
BAD = {
    "gpt2_train": ["--min-len", "64", "--max-len", "32"],
    "bert_finetune": ["--max-len", "30"],
    "llama_generate": ["--batches", "1,x"],
    "vit_train": ["--image", "30", "--patch", "8"],
    "model_switch": ["--first-hidden", "100"],
    "ddp_gloo": ["--steps", "0"],
}


def run(name, args):
    """Runs a program as `python PROGRAM.py ARGS` would, in this process;
    returns what it printed."""
    path = os.path.join(PROGRAMS, f"{name}.py")
    out = io.StringIO()
    argv = sys.argv
    sys.argv = [path, *args]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
    finally:
        sys.argv = argv
    return out.getvalue()


class Programs(unittest.TestCase):
    def test_every_program_is_listed(self):
        found = {f[:-3] for f in os.listdir(PROGRAMS) if f.endswith(".py") and not f.startswith("_")}
        # ci_churn is another's, tested by quilt-bench live's own tests.
        self.assertEqual(found - {"ci_churn"}, set(TINY))

    def test_each_runs_on_the_cpu_to_its_summary(self):
        for name, args in TINY.items():
            with self.subTest(program=name):
                lines = run(name, ["--device", "cpu", *args]).strip().splitlines()
                self.assertTrue(lines, f"{name} printed nothing")
                summary = lines[-1]
                self.assertTrue(summary.startswith(f"{name}: device=cpu "), summary)
                self.assertIn(" seconds=", summary)

    def test_each_refuses_a_bad_argument(self):
        for name, args in BAD.items():
            with self.subTest(program=name), contextlib.redirect_stderr(io.StringIO()) as err:
                with self.assertRaises(SystemExit) as exit_:
                    run(name, ["--device", "cpu", *args])
                self.assertEqual(exit_.exception.code, 2, err.getvalue())
                self.assertIn("error:", err.getvalue())


if __name__ == "__main__":
    unittest.main()
