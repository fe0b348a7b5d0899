"""scripts/bundled_model/heldout_prompts.py: held-out header prompts for the live acceptance figure."""

from __future__ import annotations

import json

from scripts.bundled_model.corpus import is_heldout
from scripts.bundled_model.heldout_prompts import main

BODY = "import os\n\n\ndef {name}(path):\n    return os.path.basename(path)\n"


def test_prompts_come_from_heldout_files_and_end_at_a_header_colon(tmp_path):
    corpus = tmp_path / "lib"
    corpus.mkdir()
    names = [f"mod{i}" for i in range(40)]
    for name in names:
        (corpus / f"{name}.py").write_text(BODY.format(name=f"f_{name}"))
    out = tmp_path / "prompts.jsonl"
    assert main(["--out", str(out), "--corpus", str(corpus), "--heldout-percent", "30", "--count", "50"]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    heldout = {n for n in names if is_heldout(f"{n}.py", 30)}
    assert len(lines) == len(heldout) > 0  # one header per held-out file, none from training files
    for line in lines:
        assert line["prompt"].endswith("(path):")
        assert line["prompt"].split("def f_")[1].split("(")[0] in heldout


def test_a_missing_corpus_is_one_clear_line(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "p.jsonl"), "--corpus", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err
