from setuptools import find_packages, setup

# The package itself runs on any torch from 2.9 (off XLA the inner backend is inductor): a plain
# `pip install -e .` keeps the torch already installed.
BASE = ["torch>=2.9", "numpy", "sympy", "tqdm"]  # tqdm: precompile's progress bar (transformers brings it too)
# torch_xla's C++ extension is built against one exact torch: pin both together (the "xla" extra, and every
# extra of the torch_xla set-up the suite is developed on).
XLA = ["torch==2.9.0", "torch_xla==2.9.0"]
CLIENTS = ["transformers==4.57.1", "peft==0.17.1"]
# The newest client releases, verified with the compat-marked tests (.ci/run's second job).
NEWEST_CLIENTS = ["transformers==5.23.0", "peft==0.21.2"]
# The newest torch (installed first, e.g. torch==2.14.1, and kept: no torch pin here) with no torch_xla, and
# the newest clients that resolve with it: .ci/run's third job runs the whole suite on it (the XLA tests skip).
# torchtune imports torchao: 0.17.0 is the release this set was verified with on torch 2.14.1.
NEWEST_TORCH = ["transformers==5.25.0", "peft==0.21.2", "torchtune==0.6.1", "torchao==0.17.0", "loralib==0.1.2",
                "pytest", "hypothesis"]
# The other LoRA formats the tests serve.  torchtune imports torchao, and left alone it pulls
# huggingface-hub 1.x, tokenizers 0.23 and datasets 4, which transformers 4.57.1 cannot import:
# pinned to the set that resolves with it.
LORA_FORMATS = ["torchtune==0.6.1", "torchao==0.14.1", "loralib==0.1.2", "huggingface-hub==0.36.2",
                "tokenizers==0.22.2", "datasets==3.6.0"]

setup(
    name="xla-lora-pass",
    version="0.1.0",
    description="A torch.compile backend that rewrites LoRA layers into fused BGMV calls on XLA",
    packages=find_packages(include=["xla_lora_pass", "xla_lora_pass.*", "graph_rewrites", "graph_rewrites.*"]),
    package_data={"graph_rewrites": ["README.md"]},
    python_requires=">=3.10",
    install_requires=BASE,
    extras_require={
        "xla": XLA,
        # The README's commands on a fresh machine: the torch_xla set-up, as before the base install took any torch.
        "demo": XLA + CLIENTS,
        "test": XLA + CLIENTS + LORA_FORMATS + ["pytest", "hypothesis"],
        "bench": XLA + CLIENTS + ["matplotlib"],
        "compat": XLA + NEWEST_CLIENTS + ["pytest", "hypothesis"],
        "newest": NEWEST_TORCH,
    },
    entry_points={
        # torch.compile(m, backend="xla_lora") finds the backend without an import.
        "torch_dynamo_backends": ["xla_lora = xla_lora_pass:xla_lora_backend"],
        "console_scripts": ["xla-lora-dump = xla_lora_pass.dump.cli:main"],
    },
)
