"""The committed gRPC stubs are exactly what `python -m proto.generate` makes."""

from pathlib import Path

from proto import generate


def test_stubs_are_fresh(tmp_path):
    generate.generate(tmp_path)
    committed = Path(generate.__file__).parent
    made = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert made, "the generator wrote nothing"
    for path in made:
        rel = path.relative_to(tmp_path / "proto")
        assert (committed / rel).read_text() == path.read_text(), f"{rel} is stale: run `python -m proto.generate`"
