"""xla_lora_pass/runtimes/xla_layer_norm.py: layer_norm traced with symbolic sizes on XLA, nothing else changed."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from xla_lora_pass.runtimes import xla_layer_norm

pytestmark = pytest.mark.xla  # torch_xla's layer_norm kernel, every test (the module fixture installs it)


@pytest.fixture(scope="module", autouse=True)
def _installed():
    assert xla_layer_norm.install() == "installed"


def _compiled_dynamic(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="openxla", dynamic=True)


def test_install_is_once_per_process():
    assert xla_layer_norm.install() == "installed" == xla_layer_norm.status()


def test_has_symbolic_size_only_for_symbolic_sizes():
    assert not xla_layer_norm.has_symbolic_size(torch.zeros(2, 3, 4), [4])
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    shape_env = ShapeEnv()
    tokens = shape_env.create_unbacked_symint()
    with FakeTensorMode(shape_env=shape_env):
        fake = torch.empty(tokens, 4)
    assert xla_layer_norm.has_symbolic_size(fake, [4])
    assert xla_layer_norm.has_symbolic_size(torch.zeros(2, 4), [tokens])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
def test_layer_norm_traces_with_symbolic_sizes(dtype, affine, xla_device):
    torch.manual_seed(0)
    norm = nn.LayerNorm(16, elementwise_affine=affine).to(dtype)
    if affine:
        with torch.no_grad():
            norm.weight.normal_(), norm.bias.normal_()
    compiled = _compiled_dynamic(norm.to(xla_device))
    for n in (3, 5, 9):  # the second size is the one that turns the dim symbolic
        x = torch.randn(2, n, 16).to(dtype)
        with torch.no_grad():
            out = compiled(x.to(xla_device)).cpu()
        ref = F.layer_norm(x.float(), (16,), *(p.detach().cpu().float() for p in norm.parameters()))
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        assert (out.float() - ref).abs().max().item() < tol
    norm.cpu()


def test_backward_through_the_symbolic_trace(xla_device):
    torch.manual_seed(0)
    cpu_norm = nn.LayerNorm(16)
    with torch.no_grad():
        cpu_norm.weight.normal_(), cpu_norm.bias.normal_()
    xla_norm = nn.LayerNorm(16).to(xla_device)
    xla_norm.load_state_dict(cpu_norm.state_dict())
    compiled = _compiled_dynamic(xla_norm)
    for n in (3, 5):
        x = torch.randn(2, n, 16)
        x_cpu, x_xla = x.clone().requires_grad_(), x.to(xla_device).requires_grad_()
        cpu_norm.zero_grad(), xla_norm.zero_grad()
        cpu_norm(x_cpu).pow(2).sum().backward()
        compiled(x_xla).pow(2).sum().backward()
        assert (x_xla.grad.cpu() - x_cpu.grad).abs().max().item() < 1e-5
        assert (xla_norm.weight.grad.cpu() - cpu_norm.weight.grad).abs().max().item() < 1e-4


def test_eager_keeps_torch_xlas_kernel(xla_device):
    # Real tensors never have symbolic sizes: eager forward and backward go to torch_xla's kernel,
    # whose program is a batch norm (ATen's C++ composite); the decomposition has none.
    import torch_xla

    torch.manual_seed(0)
    x = torch.randn(4, 16)
    x_xla = x.to(xla_device).requires_grad_()
    out = F.layer_norm(x_xla, (16,))
    assert "batch_norm" in torch_xla._XLAC._get_xla_tensors_text([out]).lower()
    out.pow(2).sum().backward()
    x_cpu = x.clone().requires_grad_()
    F.layer_norm(x_cpu, (16,)).pow(2).sum().backward()
    assert (out.detach().cpu() - F.layer_norm(x, (16,))).abs().max().item() < 1e-5
    assert (x_xla.grad.cpu() - x_cpu.grad).abs().max().item() < 1e-5


class _HFRMSNorm(nn.Module):
    """HF's Llama/Qwen RMSNorm (Gemma's differs by ``1 + weight``): torch ops, no norm kernel."""

    def __init__(self, dim, gemma=False):
        super().__init__()
        self.weight, self.gemma = nn.Parameter(torch.randn(dim)), gemma

    def forward(self, x):
        h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        return ((1 + self.weight) if self.gemma else self.weight) * h.to(x.dtype)


@pytest.mark.parametrize("norm", ["group_norm", "rms_norm", "hf_rms_norm", "gemma_rms_norm", "batch_norm_eval",
                                  "instance_norm"])
def test_other_norms_trace_without_help(norm, xla_device):
    # Only native_layer_norm has a torch_xla kernel that reads numel(): the other norms of common
    # models trace with symbolic sizes as they are (the module leaves them alone).
    torch.manual_seed(0)
    w, b = torch.randn(16), torch.randn(16)
    fns = {
        "group_norm": lambda x, w, b: F.group_norm(x.transpose(1, 2), 4, w, b),
        "rms_norm": lambda x, w, b: F.rms_norm(x, (16,), w),
        "batch_norm_eval": lambda x, w, b: F.batch_norm(x.transpose(1, 2), b, w.abs(), w, b, training=False),
        "instance_norm": lambda x, w, b: F.instance_norm(x.transpose(1, 2)),
    }
    if norm in fns:
        fn = fns[norm]
    else:
        module = _HFRMSNorm(16, gemma=norm == "gemma_rms_norm")
        fn = lambda x, w, b: module(x)  # noqa: E731
    compiled = _compiled_dynamic(lambda x, w, b: fn(x, w, b))
    for n in (3, 5):
        x = torch.randn(2, n, 16)
        if norm not in fns:
            module.to(xla_device)
        out = compiled(x.to(xla_device), w.to(xla_device), b.to(xla_device)).detach().cpu()
        if norm not in fns:
            module.cpu()
        assert (out - fn(x, w, b).detach()).abs().max().item() < 1e-4
