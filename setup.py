from setuptools import find_packages, setup

# torch_xla's C++ extension is built against one exact torch: pin both together.
TORCH = ["torch==2.9.0", "torch_xla==2.9.0"]
CLIENTS = ["transformers==4.57.1", "peft==0.17.1"]
# The newest client releases, verified with the compat-marked tests (.ci/run's second job).
NEWEST_CLIENTS = ["transformers==5.23.0", "peft==0.21.2"]
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
    install_requires=TORCH + ["sympy", "tqdm"],  # tqdm: precompile's progress bar (transformers brings it too)
    extras_require={
        "demo": CLIENTS,
        "test": CLIENTS + LORA_FORMATS + ["pytest", "hypothesis"],
        "bench": CLIENTS + ["matplotlib"],
        "compat": NEWEST_CLIENTS + ["pytest", "hypothesis"],
    },
    entry_points={
        # torch.compile(m, backend="xla_lora") finds the backend without an import.
        "torch_dynamo_backends": ["xla_lora = xla_lora_pass:xla_lora_backend"],
        "console_scripts": ["xla-lora-dump = xla_lora_pass.dump.cli:main"],
    },
)
