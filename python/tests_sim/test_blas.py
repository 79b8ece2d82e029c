"""cuBLAS on the simulated GPU: torch's matmuls through the project's
cuBLAS and cuBLASLt faces (crates/cublas, crates/cublas-lt) over the driver
double, under the allocator ``QUILT_SIM_ALLOCATOR`` names (``classic``,
``expandable`` or ``quilt``; see ``test_simulated_gpu.py``).

A GEMM computes nothing on the double: it is queued on its stream as opaque
work, so these tests check what does not depend on values: shapes, dtypes,
devices, gradients present, stream order (a GEMM keeps its stream busy until
it runs), capture and replay, and that the allocator served every tensor.
"""

import os
import unittest

ALLOCATOR = os.environ.get("QUILT_SIM_ALLOCATOR", "classic")

if ALLOCATOR == "quilt":
    import quilt_torch

    quilt_torch.enable()

import torch  # noqa: E402  (after enable(), which must come first)

torch.backends.cudnn.enabled = False

try:
    import transformers
except ImportError:  # scripts/torch-venv.sh installs it; say so where it did not
    transformers = None


def allocations():
    return torch.cuda.memory_stats()["allocation.all.allocated"]


class Blas(unittest.TestCase):
    def setUp(self):
        torch.manual_seed(0)

    def test_linear_forward_and_backward(self):
        layer = torch.nn.Linear(256, 128).cuda()
        x = torch.randn(32, 256, device="cuda", requires_grad=True)
        before = allocations()
        y = layer(x)
        y.sum().backward()
        torch.cuda.synchronize()
        self.assertEqual(y.shape, (32, 128))
        self.assertEqual(layer.weight.grad.shape, (128, 256))
        self.assertEqual(layer.bias.grad.shape, (128,))
        self.assertEqual(x.grad.shape, (32, 256))
        for t in (y, layer.weight.grad, layer.bias.grad, x.grad):
            self.assertEqual(t.device.type, "cuda")
        # The output and the three gradients came from the allocator.
        self.assertGreaterEqual(allocations() - before, 4)

    def test_matmul_bmm_addmm_in_fp32(self):
        a = torch.randn(4, 48, 40, device="cuda")
        b = torch.randn(4, 40, 24, device="cuda")
        self.assertEqual(torch.bmm(a, b).shape, (4, 48, 24))
        self.assertEqual(torch.matmul(a, b).shape, (4, 48, 24))
        self.assertEqual((a[0] @ b[0]).shape, (48, 24))
        self.assertEqual(torch.addmm(torch.zeros(48, 24, device="cuda"), a[0], b[0]).shape, (48, 24))
        self.assertEqual(torch.matmul(a[0], b[0, :, 0]).shape, (48,))  # a GEMV
        self.assertEqual(torch.baddbmm(torch.zeros(4, 48, 24, device="cuda"), a, b).shape, (4, 48, 24))
        # Transposed and strided operands.
        self.assertEqual((a[0].t().contiguous().t() @ b[0]).shape, (48, 24))
        self.assertEqual(torch.bmm(b.transpose(1, 2), a.transpose(1, 2)).shape, (4, 24, 48))
        torch.cuda.synchronize()

    def test_autocast_fp16_and_bf16(self):
        layer = torch.nn.Linear(64, 32).cuda()
        x = torch.randn(16, 64, device="cuda")
        for dtype in (torch.float16, torch.bfloat16):
            with torch.autocast("cuda", dtype=dtype):
                y = layer(x)
                z = torch.bmm(x.view(4, 4, 64), x.view(4, 64, 4))
            self.assertEqual(y.dtype, dtype)
            self.assertEqual(z.dtype, dtype)
            y.float().sum().backward()
            self.assertEqual(layer.weight.grad.dtype, torch.float32)
            layer.zero_grad()
        half = torch.randn(32, 32, device="cuda", dtype=torch.float16)
        self.assertEqual((half @ half).dtype, torch.float16)
        torch.cuda.synchronize()

    def test_gemm_is_queued_on_the_current_stream(self):
        a = torch.randn(256, 256, device="cuda")
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            c = a @ a
        self.assertFalse(side.query(), "the GEMM's work is not on the side stream")
        side.synchronize()
        self.assertTrue(side.query())
        c.record_stream(side)

    def test_graph_capture_and_replay_of_a_linear_layer(self):
        layer = torch.nn.Linear(64, 32).cuda()
        x = torch.randn(8, 64, device="cuda")
        warm = torch.cuda.Stream()
        warm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(warm):
            for _ in range(2):
                layer(x)
        torch.cuda.current_stream().wait_stream(warm)
        graph = torch.cuda.CUDAGraph()
        # Expandable segments map a new segment for the graph's pool during
        # the capture, which CUDA refuses in global mode (see
        # test_simulated_gpu.py); relaxed mode is what torch documents.
        with torch.cuda.graph(graph, capture_error_mode="relaxed"):
            out = layer(x)
        for _ in range(2):
            graph.replay()
        torch.cuda.synchronize()
        self.assertEqual(out.shape, (8, 32))
        del graph, out

    @unittest.skipIf(transformers is None, "transformers is not installed (scripts/torch-venv.sh installs it)")
    def test_transformers_training_step(self):
        config = transformers.GPT2Config(
            vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=4,
            bos_token_id=0, eos_token_id=1, loss_type="ForCausalLM",
        )
        model = transformers.GPT2LMHeadModel(config).cuda()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for length in (16, 24):
            ids = torch.randint(0, 512, (2, length), device="cuda")
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        self.assertEqual(loss.shape, ())
        states = [s for s in optimizer.state.values()]
        self.assertEqual(len(states), len(list(model.parameters())))
        self.assertTrue(all(s["exp_avg"].device.type == "cuda" for s in states))


if __name__ == "__main__":
    unittest.main()
