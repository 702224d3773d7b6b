"""Issue 5: the dump tool, the per-compile dump folder, TORCH_TRACE artifacts, the HTML view in a browser."""
import html
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch

import xla_lora_pass as xlp
from xla_lora_pass import config
from xla_lora_pass.demo_models import demo_llama_with_near_misses
from xla_lora_pass.dump import TRACE_AFTER, TRACE_BEFORE, TRACE_REPORT, dump_graphs
from xla_lora_pass.dump import cli
from xla_lora_pass.dump.views import render_dot, render_html, render_text

from .models import peft_two_layer
from .png import read_png, size_of

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARTIFACTS = os.path.join(REPO, "test-artifacts")
BIN = os.path.dirname(sys.executable)


def two_layer_factory():
    """A dump factory for fast CLI tests: one PEFT LoRA site on ``proj``, input [2, 3, 16]."""
    return peft_two_layer(), (torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(0)),)


@pytest.fixture(scope="module")
def near_miss_dump():
    """The demo Llama with v_proj scaled per channel: 2 q_proj sites rewritten, 2 v_proj near misses."""
    model, inputs = demo_llama_with_near_misses()
    meta = xlp.LoRAMetadata(max_num_tokens=256)
    meta.register_adapters(model)
    dumps = cli.dump_model(model, (), inputs, meta)
    return dict(model=model, meta=meta, dumps=dumps, buckets=xlp.Buckets.pow2(min=8, max=256))


def test_report_matches_the_models_lora_layers(near_miss_dump):
    meta, [dump] = near_miss_dump["meta"], near_miss_dump["dumps"]
    report = dump.report
    rewritten = {s.site for s in report.sites}
    missed = {m.site for m in report.near_misses}
    assert rewritten | missed == set(meta.sites) and not rewritten & missed, report.format()
    assert rewritten == {s for s in meta.sites if s.endswith("q_proj")}
    before = {n.name for n in dump.before.graph.nodes}
    after = {n.name for n in dump.after.graph.nodes}
    for s in report.sites:
        spec = meta.sites[s.site]
        assert (s.rank, s.num_slots) == (meta.site_rank(s.site), meta.num_slots) == (8, 3)
        assert list(s.x_shape) == [2, 6, spec.in_features] and list(s.out_shape) == [2, 6, spec.out_features]
        assert s.replaced and set(s.replaced) <= before and not set(s.replaced) & after
    for m in report.near_misses:
        assert m.site.endswith("v_proj")
        assert re.fullmatch(r"adapter '\w+' scales its delta by a tensor of shape \[\d+\], not one number", m.reason)
        assert set(m.nodes) <= before & after  # left exactly as they were


def test_text_dump_lists_every_site_and_near_miss(near_miss_dump):
    [dump] = near_miss_dump["dumps"]
    text = render_text(near_miss_dump["dumps"], near_miss_dump["buckets"], title="demo")
    for s in dump.report.sites:
        assert re.search(rf"rewritten  {re.escape(s.site)}  \[lora_linear\].*rank 8  slots 3  replaced "
                         rf"{re.escape(', '.join(s.replaced))}", text)
    for m in dump.report.near_misses:
        assert f"near miss  {m.site}  [lora_linear]  {m.reason}" in text
    before, after = text.split("=== graph 0: before the rewrite ===")[1].split("=== graph 0: after the rewrite ===")
    assert "xla_lora.bgmv_" not in before
    # Either kernel (config.kernel): masked bgmv_shrink/expand or their row forms.
    assert len(re.findall(r"torch\.ops\.xla_lora\.bgmv_shrink(_rows)?\.default\(", after)) == 2
    assert len(re.findall(r"torch\.ops\.xla_lora\.bgmv_expand(_rows)?\.default\(", after)) == 2
    assert "     256  129-256         50%" in text  # the bucket table


def test_html_highlights_new_and_replaced_nodes(near_miss_dump):
    [dump] = near_miss_dump["dumps"]
    page = render_html(near_miss_dump["dumps"], near_miss_dump["buckets"], title="demo")
    assert 'id="graph0-before"' in page and 'id="graph0-after"' in page
    replaced = [name for s in dump.report.sites for name in s.replaced]
    marked = re.findall(r'class="n replaced" data-node="(\w+)"', page)
    assert sorted(marked) == sorted(replaced)
    kernels = re.findall(r'class="n new kernel" data-node="\w+"[^>]*>([^<]*)', page)
    assert len(kernels) == 4 and all("torch.ops.xla_lora.bgmv_" in k for k in kernels)
    near = re.findall(r'class="n nearmiss" data-node="(\w+)"', page)
    assert sorted(near) == sorted(2 * [n for m in dump.report.near_misses for n in m.nodes])  # in both graphs
    for m in dump.report.near_misses:
        assert html.escape(m.reason) in page


def test_dot_has_both_graphs_with_edges(near_miss_dump):
    dot = render_dot(near_miss_dump["dumps"])
    assert dot.startswith("digraph xla_lora_dump {") and dot.rstrip().endswith("}")
    assert "subgraph cluster_0_before {" in dot and "subgraph cluster_0_after {" in dot
    assert dot.count("fillcolor=\"#7fd67f\"") == 4  # the BGMV calls
    assert re.search(r'"g0_after_bgmv_shrink(_rows)?_default" -> ', dot)


def _chromium():
    """The Chromium binary, or a skip with the reason; in CI a missing browser is a failure unless .ci/run
    explained why it could not install one."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    reason = os.environ.get("CHROMIUM_UNAVAILABLE")
    if reason:
        pytest.skip(f"chromium could not be installed: {reason}")
    if os.environ.get("CI"):
        pytest.fail("chromium is missing in CI: .ci/run should have installed it (apt-get install -y chromium)")
    pytest.skip("chromium is not installed here: apt-get install -y chromium (.ci/run installs it)")


def test_html_view_renders_in_headless_chromium(near_miss_dump):
    chromium = _chromium()
    os.makedirs(ARTIFACTS, exist_ok=True)
    html_path = os.path.join(ARTIFACTS, "dump_demo_llama_with_near_misses.html")
    png_path = os.path.join(ARTIFACTS, "dump_demo_llama_with_near_misses.png")
    if os.path.exists(png_path):
        os.remove(png_path)
    page = render_html(near_miss_dump["dumps"], near_miss_dump["buckets"], title="demo_llama_with_near_misses")
    with open(html_path, "w") as f:
        f.write(page)
    with tempfile.TemporaryDirectory() as profile:
        run = subprocess.run(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", f"--screenshot={png_path}", "--window-size=1400,900",
             "file://" + html_path],
            capture_output=True, text=True, timeout=180)
    assert os.path.exists(png_path), f"no screenshot (exit {run.returncode}): {run.stderr[-2000:]}"
    assert size_of(png_path) == (1400, 900)
    pixels = read_png(png_path)[..., :3].reshape(-1, 3)
    assert len(np.unique(pixels, axis=0)) > 50, "the screenshot is (nearly) blank"
    # The legend and the report tables sit in the first screen: their highlight colours must be painted.
    for css in ("#dcf5dc", "#f9d2d2", "#fff0bf"):
        rgb = np.array([int(css[i:i + 2], 16) for i in (1, 3, 5)], dtype=np.uint8)
        assert (pixels == rgb).all(axis=1).sum() > 100, f"{css} not painted"


# ------------------------------------------------------------------ CLI


def test_console_script_backend_mode_reports_compiles(tmp_path):
    out = tmp_path / "dump.txt"
    run = subprocess.run(
        [os.path.join(BIN, "xla-lora-dump"), "tests.test_dump:two_layer_factory", "--backend", "--format", "text",
         "--buckets", "pow2:8:64", "--max-num-tokens", "64", "--inner", "aot_eager", "-o", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    text = out.read_text()
    assert "1 LoRA sites rewritten, 0 near misses" in text
    assert "compiles: 1" in text and "rewrites: {'lora_linear': 1}" in text
    assert "Buckets([8, 16, 32, 64])" in text
    assert re.search(r"torch\.ops\.xla_lora\.bgmv_expand(_rows)?\.default\(", text)


def test_open_writes_the_page_and_opens_it(monkeypatch, tmp_path, capsys):
    opened = []
    monkeypatch.setattr(cli.webbrowser, "open", opened.append)
    path = tmp_path / "view.html"
    assert cli.main(["tests.test_dump:two_layer_factory", "--format", "html", "--open", "-o", str(path)]) == 0
    assert opened == [path.resolve().as_uri()]
    assert "torch.ops.xla_lora.bgmv_shrink" in path.read_text()


@pytest.mark.parametrize("argv, message", [
    (["no_colon_here"], "expected MODULE:FACTORY"),
    (["tests.no_such_module:f"], "cannot import 'tests.no_such_module'"),
    (["tests.test_dump:nothing"], "has no callable 'nothing'"),
    (["tests.test_dump:two_layer_factory", "--buckets", "pow3:1"], "bad --buckets"),
    (["tests.test_dump:two_layer_factory", "--open"], "--open needs --format html"),
])
def test_cli_errors_are_clear(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_parse_buckets():
    assert cli.parse_buckets(None, 64).sizes == (8, 16, 32, 64)
    assert cli.parse_buckets("pow2_then_gap:8:32:128", 0).sizes == (8, 16, 32, 64, 96, 128)
    assert cli.parse_buckets("4,12", 0).sizes == (4, 12)


# ------------------------------------------------------------------ backend dumps


def _compile_two_sizes(meta):
    """One PEFT site compiled through the backend and called with 2 then 3 rows: two Dynamo compiles."""
    model = peft_two_layer()
    meta.register_adapters(model)
    backend = xlp.make_backend(meta, buckets=xlp.Buckets.pow2(min=8, max=64), inner="aot_eager")
    compiled = torch.compile(model, backend=backend)
    torch._dynamo.reset()
    with torch.no_grad():
        for rows in (2, 3):
            meta.set_token_adapters(["sql"] * rows * 3)
            compiled(torch.randn(rows, 3, 16))
    torch._dynamo.reset()
    return backend


def test_dump_dir_gets_one_folder_per_compile(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(config, "dump_dir", str(tmp_path / "dumps"))
    backend = _compile_two_sizes(xlp.LoRAMetadata(max_num_tokens=64))
    folders = sorted(os.listdir(tmp_path / "dumps"))
    assert len(backend.graphs) == 2 and folders == ["compile_000", "compile_001"]
    for folder, graph in zip(folders, backend.graphs):
        path = tmp_path / "dumps" / folder
        assert sorted(os.listdir(path)) == ["after.py", "before.py", "report.txt", "view.html"]
        assert "xla_lora.bgmv_" not in (path / "before.py").read_text()
        assert (path / "after.py").read_text() == graph.gm.print_readable(print_output=False)
        report = (path / "report.txt").read_text()
        assert report.startswith("Dynamo compile id: 0/") and graph.report.format() in report
    assert capsys.readouterr().out == ""  # passes and dumps log, they never print


def test_dump_folders_number_on_and_unwritable_dir_never_fails(tmp_path, caplog):
    model, args = two_layer_factory()
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    [(gm, example_inputs)] = cli.capture_graphs(model, args, {})
    new_gm, report = xlp.rewrite(gm, example_inputs, meta)
    (tmp_path / "compile_000").mkdir()  # left by an earlier run
    assert dump_graphs(str(tmp_path), gm, new_gm, report) == str(tmp_path / "compile_001")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="xla_lora_pass.dump"):
        assert dump_graphs(str(blocker / "sub"), gm, new_gm, report) is None
    assert "could not write the graph dump" in caplog.text


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_torch_trace_gets_before_after_and_report_artifacts():
    """What TORCH_TRACE (and so tlparse) receives: one artifact each per compile, tagged with the compile id."""
    from torch._logging._internal import trace_log

    handler, level = _Collect(), trace_log.level
    trace_log.addHandler(handler)
    trace_log.setLevel(logging.DEBUG)
    try:
        backend = _compile_two_sizes(xlp.LoRAMetadata(max_num_tokens=64))
    finally:
        trace_log.removeHandler(handler)
        trace_log.setLevel(level)
    ours = [(r.metadata["artifact"]["name"], r.metadata.get("frame_compile_id"), r.payload)
            for r in handler.records if r.metadata.get("artifact", {}).get("name", "").startswith("xla_lora")]
    names = [name for name, _, _ in ours]
    assert names == [TRACE_BEFORE, TRACE_AFTER, TRACE_REPORT] * 2
    assert [cid for _, cid, _ in ours] == [0, 0, 0, 1, 1, 1]
    assert ours[1][2] == backend.graphs[0].gm.print_readable(print_output=False)
    assert "torch.ops.xla_lora.bgmv_shrink" in ours[4][2]
    assert ours[5][2] == backend.graphs[1].report.format()


def test_missing_chromium_fails_in_ci_unless_ci_explained_why(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setenv("CI", "1")
    monkeypatch.delenv("CHROMIUM_UNAVAILABLE", raising=False)
    with pytest.raises(pytest.fail.Exception, match="should have installed it"):
        _chromium()
    monkeypatch.setenv("CHROMIUM_UNAVAILABLE", "no network")
    with pytest.raises(pytest.skip.Exception, match="could not be installed: no network"):
        _chromium()


def test_node_changes_and_node_lines_of_one_site(monkeypatch):
    """NodeChanges tells new, replaced and untouched nodes apart by name; node_line shows the kernel call."""
    from xla_lora_pass.dump.views import node_line

    monkeypatch.setattr(xlp.config, "kernel", "masked")  # the lines below name the masked kernel's nodes
    model, args = two_layer_factory()
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    [dump] = cli.dump_model(model, args, {}, meta)
    ch = dump.changes()
    [site] = dump.report.sites
    assert set(ch.replaced) == set(site.replaced) and not ch.near_miss and not ch.removed
    new = {n.name: n for n in dump.after.graph.nodes if n.name in ch.new}
    assert {"lora_token_indices", "lora_a_base_model_model_proj", "lora_b_base_model_model_proj"} <= set(new)
    lines = {name: node_line(node) for name, node in new.items()}
    assert lines["lora_token_indices"] == "lora_token_indices: i32[64]  # input, fed by the backend: token_indices"
    [shrink] = [line for line in lines.values() if line.startswith("bgmv_shrink")]
    assert shrink.startswith("bgmv_shrink_default: f32[6, 4] = torch.ops.xla_lora.bgmv_shrink.default(")
    assert "lora_a_base_model_model_proj" in shrink, shrink
