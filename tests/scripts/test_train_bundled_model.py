"""scripts/train_bundled_model.py (issue 7): a tiny end-to-end run, its folders, its evaluation, bad input."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from ignition.models.checkpoint import load_checkpoint
from scripts.bundled_model import evaluate as ev
from scripts.bundled_model.corpus import is_heldout, read_sources
from scripts.bundled_model.train import distillation_loss
from scripts.train_bundled_model import main

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TINY_TARGET = "layers=2,hidden=32,heads=2,kv_heads=1,head_dim=16,ffn=64"
TINY_DRAFT = "layers=1,hidden=16,heads=1,kv_heads=1,head_dim=16,ffn=32"
SNIPPET = '''\
def {name}(values, limit={n}):
    """Sum the values below the limit."""
    total = 0
    for value in values:
        if value < limit:
            total += value * {n}
    return total


class {cls}:
    def __init__(self, size):
        self.size = size

    def grow(self, step):
        self.size += step
        return self.size
'''


def write_corpus(folder: Path, files: int = 12) -> Path:
    for i in range(files):
        body = "".join(SNIPPET.format(name=f"total_{i}_{k}", cls=f"Box{i}{k}", n=k + i) for k in range(4))
        (folder / f"module_{i}.py").write_text(f"import os\n\n\n{body}")
    (folder / "site-packages").mkdir()
    (folder / "site-packages" / "foreign.py").write_text("x = 1\n")
    return folder


def tiny_args(corpus: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--out", str(out / "model"), "--corpus", str(corpus), "--summary", str(out / "summary.json"),
        "--heldout-percent", "30", "--vocab-size", "300", "--context", "32", "--max-positions", "128",
        "--batch-size", "4", "--target-shape", TINY_TARGET, "--draft-shape", TINY_DRAFT,
        "--target-steps", "4", "--draft-steps", "3", "--warmup-steps", "2", "--no-compile", "--threads", "1",
        "--eval-windows", "3", "--long-context-windows", "1", "--spec-prompts", "2", "--spec-prompt-tokens", "12",
        "--spec-new-tokens", "6", "--headers", "3", "--header-new-tokens", "8", "--samples", "2", *extra,
    ]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("tiny")
    corpus = _mk(root / "corpus")
    assert main(tiny_args(corpus, root, "--draft-loss", "distill")) == 0
    return root, json.loads((root / "summary.json").read_text())


def _mk(folder: Path) -> Path:
    folder.mkdir()
    return write_corpus(folder)


def test_summary_reports_every_figure_issue_7_asks_for(tiny_run):
    _, summary = tiny_run
    heldout = summary["evaluation"]["heldout"]
    for key in ("target_loss", "target_perplexity", "draft_loss", "draft_perplexity", "greedy_agreement"):
        assert key in heldout and heldout[key] == heldout[key], key  # present and not NaN
    assert 0.0 <= heldout["greedy_agreement"] <= 1.0
    for depth in ("D3", "D5"):
        spec = summary["evaluation"]["speculation"][depth]
        assert 0.0 <= spec["mean_accepted_length"] <= int(depth[1:])
        assert 0.0 <= spec["acceptance_rate"] <= 1.0
    headers = summary["evaluation"]["headers"]
    assert headers["headers"] == 3 and 0 <= headers["parsed"] <= 3
    assert len(headers["samples"]) == 2 and all(s["prompt_line"].endswith(":") for s in headers["samples"])
    assert set(summary["evaluation"]["loss_by_position"]["target"]) == {"0-128"}
    assert summary["target"]["training"]["steps"] == 4 and summary["draft"]["training"]["steps"] == 3
    assert summary["draft"]["loss"] == "distill"
    assert summary["target"]["parameters"] > summary["draft"]["parameters"]


def test_split_is_by_whole_file_and_skips_site_packages(tiny_run):
    root, summary = tiny_run
    corpus = summary["corpus"]
    assert corpus["train_files"] + corpus["heldout_files"] == 12  # site-packages/foreign.py not read
    expected_heldout = sum(is_heldout(f"module_{i}.py", 30) for i in range(12))
    assert corpus["heldout_files"] == expected_heldout


def test_folders_load_through_flare_and_transformers_with_the_same_weights(tiny_run):
    root, summary = tiny_run
    for name, layers, hidden in (("target", 2, 32), ("draft", 1, 16)):
        folder = root / "model" / name
        ckpt = load_checkpoint(folder)
        assert (ckpt.config.num_layers, ckpt.config.hidden_size) == (layers, hidden)
        assert ckpt.config.max_position_embeddings == 128
        assert ckpt.config.output_vocab_size == ckpt.config.vocab_size == summary["tokenizer"]["vocab_size"]
        assert all(t.dtype == torch.bfloat16 for t in ckpt.weights.values())  # the default --save-dtype
        hf = transformers.Qwen3ForCausalLM.from_pretrained(folder).eval()
        state = hf.state_dict()
        for key, tensor in ckpt.weights.items():
            torch.testing.assert_close(state[key].float(), tensor.float(), rtol=0, atol=0, msg=key)
    on_disk = sum(f.stat().st_size for f in (root / "model").rglob("*") if f.is_file())
    assert summary["size_bytes"] == on_disk


def test_tokenizer_is_trained_bpe_with_special_tokens_and_chat_template(tiny_run):
    root, _ = tiny_run
    folder = root / "model" / "target"
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
    assert None not in ids
    text = "def grow(self, step):\n        return self.size  # é\n"
    encoded = tok.encode(text).ids
    assert tok.decode(encoded) == text
    assert len(encoded) < len(text.encode())  # merges were learned
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>" and "<|im_start|>" in config["chat_template"]
    hf_config = json.loads((folder / "config.json").read_text())
    assert hf_config["model_type"] == "qwen3" and hf_config["eos_token_id"] == ids[2]


def test_missing_corpus_is_one_clear_line_and_exit_2(tmp_path, capsys):
    assert main(tiny_args(tmp_path / "nowhere", tmp_path)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nowhere" in err and "no such folder" in err
    assert not (tmp_path / "model").exists()


def test_corpus_without_python_text_is_one_clear_line_and_exit_2(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "notes.txt").write_text("not python\n")
    (corpus / "empty.py").write_text("   \n")
    (corpus / "latin1.py").write_bytes(b"x = '\xe9'\n")
    assert main(tiny_args(corpus, tmp_path)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no non-empty UTF-8 .py file" in err


def test_bad_shape_is_one_clear_line_and_exit_2(tmp_path, capsys):
    corpus = _mk(tmp_path / "corpus")
    assert main(tiny_args(corpus, tmp_path) + ["--target-shape", "layers=two"]) == 2
    assert "layers=two" in capsys.readouterr().err


def test_read_sources_is_sorted_and_relative(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.py").write_text("z = 1\n")
    (tmp_path / "a.py").write_text("a = 1\n")
    assert [f.path for f in read_sources(tmp_path)] == ["a.py", "b/z.py"]


def _random_model(seed: int, layers: int = 1) -> transformers.Qwen3ForCausalLM:
    # untied: a tied random model's argmax just repeats its input token, whatever the seed
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(vocab_size=50, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=16, intermediate_size=48,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    return transformers.Qwen3ForCausalLM(config).eval()


def test_greedy_with_kv_cache_matches_full_recomputation():
    model = _random_model(1, layers=2)
    prompt = [3, 14, 15, 9, 2]
    sequence = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            sequence.append(int(model(input_ids=torch.tensor([sequence])).logits[0, -1].argmax()))
    assert ev.greedy(model, prompt, 6) == sequence[len(prompt):]


def test_speculation_with_the_target_as_its_own_draft_accepts_everything():
    model = _random_model(2)
    tallies = ev.speculate(model, model, [1, 2, 3], 9, (3, 5))
    assert tallies[3].accepted == tallies[3].offered and tallies[3].rounds == 3  # 3 proposals + 1 bonus per round
    assert tallies[5].accepted == tallies[5].offered


def test_speculation_with_an_unrelated_draft_accepts_less_than_with_the_target():
    target, other = _random_model(3), _random_model(4)
    own = ev.speculate(target, target, [5, 6, 7], 12, (3,))[3]
    foreign = ev.speculate(target, other, [5, 6, 7], 12, (3,))[3]
    assert foreign.accepted < own.accepted and foreign.rounds > own.rounds


def test_distillation_loss_is_zero_only_when_the_student_matches_the_teacher():
    teacher = _random_model(5)
    inputs = torch.tensor([[1, 2, 3, 4]])
    same = teacher(input_ids=inputs).logits.detach()
    objective = distillation_loss(teacher, bf16=False)
    assert float(objective(same, inputs, inputs)) == pytest.approx(0.0, abs=1e-5)
    assert float(objective(same + torch.randn_like(same), inputs, inputs)) > 1e-3


@pytest.mark.parametrize("continuation, expected", [
    ("\n    return x + 1\n    y = (", True),  # the unfinished last line is trimmed away
    ("\n    if x:\n        return 1\n", True),
    ("):):):)", False),  # no complete line: no body
    ("\n    return x +\n", False),
])
def test_header_continuation_parses_after_trimming_to_the_last_complete_line(continuation, expected):
    assert ev.parses_after_trim("def f(x):", continuation) is expected


def test_function_headers_are_top_level_one_line_defs_ending_at_the_colon():
    from scripts.bundled_model.corpus import SourceFile
    text = textwrap.dedent('''\
        import os

        def one(a, b):
            return a

        def two(
            a,
        ):
            return a

        def three(): return 3

        class C:
            def method(self):
                return 1
        ''')
    headers = ev.function_headers((SourceFile("m.py", text),), 10, seed=0)
    assert [h.line for h in headers] == ["def one(a, b):"]
    assert headers[0].context == "import os\n\n"


def test_round_weights_leaves_exactly_the_values_that_bfloat16_storage_keeps():
    from scripts.bundled_model.models import round_weights
    model = _random_model(6)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    round_weights(model, "bfloat16")
    for key, value in model.state_dict().items():
        assert value.dtype == torch.float32
        torch.testing.assert_close(value, before[key].to(torch.bfloat16).float(), rtol=0, atol=0, msg=key)
    assert any(not torch.equal(model.state_dict()[k], before[k]) for k in before)  # rounding changed something


def test_a_time_budget_fixes_the_step_count_after_the_timed_warmup():
    from scripts.bundled_model.train import PhaseSettings, TokenStream, next_token_loss, train_phase
    model = _random_model(7)
    settings = PhaseSettings(minutes=1e-6, steps=None, context=8, batch_size=2, learning_rate=1e-3,
                             warmup_steps=6, seed=0, bf16=False, compile=False)
    report = train_phase(model, TokenStream(torch.randint(0, 50, (200,))), settings, next_token_loss, lambda _: None)
    assert report.steps == 6  # the budget is spent, so training stops as soon as the count is fixed
    assert report.tokens == 6 * 2 * 8 and report.final_train_loss == report.final_train_loss


def test_init_from_continues_the_saved_pair_with_its_tokenizer(tiny_run, tmp_path):
    """--init-from starts both models from a saved run: a step at learning rate 0 leaves its weights as they were."""
    root, _ = tiny_run
    args = tiny_args(root / "corpus", tmp_path, "--init-from", str(root / "model"), "--target-lr", "0", "--draft-lr", "0")
    args[args.index("--target-steps") + 1] = args[args.index("--draft-steps") + 1] = "1"
    assert main(args) == 0
    for name in ("target", "draft"):
        before, after = load_checkpoint(root / "model" / name), load_checkpoint(tmp_path / "model" / name)
        assert all(torch.equal(before.weights[k], after.weights[k]) for k in before.weights), name
        assert (tmp_path / "model" / name / "tokenizer.json").read_text() == \
            (root / "model" / name / "tokenizer.json").read_text()


@pytest.mark.parametrize("problem, words", [("missing", "no target/tokenizer.json"), ("shape", "another shape")])
def test_init_from_a_wrong_folder_is_one_clear_line_and_exit_2(tiny_run, tmp_path, capsys, problem, words):
    root, _ = tiny_run
    folder = tmp_path / "nowhere" if problem == "missing" else root / "model"
    extra = ["--init-from", str(folder)] + (["--target-shape", "layers=1"] if problem == "shape" else [])
    args = tiny_args(root / "corpus", tmp_path, *extra)
    if problem == "shape":  # the later --target-shape overrides the tiny one
        args[args.index("--target-shape") + 1] = TINY_TARGET.replace("layers=2", "layers=1")
    assert main(args) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and words in errors[0], errors
    assert not (tmp_path / "model").exists()
