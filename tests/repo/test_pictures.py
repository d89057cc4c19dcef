"""The documentation's pictures are drawn by code: the architecture from raysgd's own code, the benchmarks' from
their results. Each drawing function runs here on real code or a small result and writes a PNG."""
import doctest
import importlib.util
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"

pytest.importorskip("matplotlib", reason="the pictures need matplotlib (the logging or test extra)")


def load(path):
    """A script of the repository (not a package) as a module."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def plots():
    return load(REPO / "benchmarks" / "plots.py")


def test_the_architecture_is_drawn_from_the_code(tmp_path):
    draw = load(REPO / "tools" / "draw_architecture.py")
    assert doctest.testmod(draw).failed == 0
    draw.main(["--runtime", str(tmp_path / "run.png"), "--layers", str(tmp_path / "layers.png")])
    assert (tmp_path / "run.png").read_bytes().startswith(PNG) and (tmp_path / "layers.png").read_bytes()[:8] == PNG
    for _, _, code, *_ in draw.BOXES:  # every class the picture names exists where the picture says
        if code is not None:
            name, source = draw.component(code)
            assert (REPO / "raysgd" / source).is_file() and name
    units, edges = draw.unit_graph()
    assert {"raysgd.torch.execution", "raysgd.torch.state"} <= set(units)
    glue = draw.layer_table()[1]
    assert all(units[dst][0] < units[src][0] for src, dst in edges if units[src][0] != glue), \
        "the picture shows imports pointing down only, as tests/repo/test_layers.py checks"


def test_throughput_picture(plots, tmp_path):
    runs = [dict(model=model, side=side, workers=n, samples_per_s=rate * n)
            for model, rate in (("mlp", 7000), ("resnet", 1000))
            for side, n in (("plain", 1), ("torchrun", 1), ("raytrain", 1), ("raysgd", 1), ("torchrun", 2),
                            ("raytrain", 2), ("raysgd", 2))]
    out = plots.throughput({"runs": runs, "meta": {"date": "2026-11-22", "smoke": True}}, tmp_path / "t.png")
    assert pathlib.Path(out).read_bytes().startswith(PNG)


def test_recovery_timeline_picture(plots, tmp_path):
    timeline = [[t / 10, rank] for t in range(-20, 0) for rank in (0, 1)] + [[3.0 + t / 10, r] for t in range(30)
                                                                            for r in (0, 1)]
    rows = [dict(case=case, event=event, event_to_resumed_s=resumed, repeats=3, timeline=timeline,
                 meta={"date": "2026-11-27"}) for case, event, resumed in
            (("process", "rank 1's process killed", 3.0), ("spare", "rank 1's process killed, with a spare", 0.4))]
    assert pathlib.Path(plots.recovery(rows, tmp_path / "r.png")).read_bytes().startswith(PNG)
    with pytest.raises(ValueError, match="no row has a timeline"):
        plots.recovery([{"case": "x"}], tmp_path / "none.png")


def test_fsdp_memory_picture(plots, tmp_path):
    rows = [dict(strategy=s, workers=n, state_mb=200 / (n if s == "fsdp" else 1), peak_rise_mb=300 / n)
            for n in (1, 2, 4) for s in ("ddp", "fsdp")]
    out = plots.fsdp_memory({"rows": rows, "meta": {"parameters": 12.6e6, "cpus": 2}}, tmp_path / "f.png")
    assert pathlib.Path(out).read_bytes().startswith(PNG)
    assert doctest.testmod(plots).failed == 0


def test_the_docs_show_the_pictures():
    """Every picture in docs/images is used by a page, and every page's picture exists."""
    pages = "\n".join(p.read_text() for p in (REPO / "docs").rglob("*.md")) + (REPO / "README.md").read_text()
    for image in (REPO / "docs" / "images").glob("*.png"):
        assert f"images/{image.name}" in pages, f"docs/images/{image.name} is shown nowhere"
