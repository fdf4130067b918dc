"""tools/train_probe.py at toy size on CPU: the checkpoint it saves loads in transformers and in sparsekv."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
TOY = ["--device", "cpu", "--max-len", "512", "--min-len", "256", "--hidden", "64", "--intermediate", "128",
       "--layers", "2", "--heads", "2", "--kv-heads", "1", "--head-dim", "32", "--micro-tokens", "1024",
       "--accum", "2", "--eval-samples", "1", "--log-every", "1"]
TRIAL_WEIGHTS = "niah_multikey=2,niah_multivalue=1,niah_multiquery=1,variable_tracking=2.5,common_words=0.5"


@pytest.fixture(scope="module")
def train_probe():
    spec = importlib.util.spec_from_file_location("train_probe", TOOLS / "train_probe.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("train_probe", module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def probe_data(train_probe):
    import importlib

    return importlib.import_module("probe_data")  # tools/ is on sys.path once train_probe is loaded


@pytest.fixture(scope="module")
def trained(train_probe, tmp_path_factory):
    import contextlib
    import io

    out = tmp_path_factory.mktemp("probe")
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        train_probe.main(["--out", str(out), "--steps", "3", "--workers", "1", *TOY])
    return out, log.getvalue()


def test_toy_run_logs_steps_and_held_out_accuracy(trained):
    out, log = trained
    assert [line.split()[1] for line in log.splitlines() if line.startswith("step ")] == ["1/3", "2/3", "3/3"]
    assert "held-out accuracy" in log and "stopped early" not in log
    record = json.loads((out / "training.json").read_text())
    assert record["steps_done"] == 3 and not record["stopped_early"]
    assert set(record["eval"]) == {"niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery",
                                   "variable_tracking", "common_words", "kv_adjacent"}


def test_checkpoint_loads_in_transformers(trained):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = trained
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["max_position_embeddings"] >= 65536
    shards = list(out.glob("*.safetensors"))
    assert shards and all(p.stat().st_size <= 15 * 10**6 for p in shards)
    model = AutoModelForCausalLM.from_pretrained(str(out))
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert model.config.head_dim == 32 and model.config.vocab_size >= len(tokenizer)
    ids = tokenizer("The special magic number for amber is", return_tensors="pt")["input_ids"]
    assert tokenizer.unk_token_id not in ids[0].tolist()
    with torch.no_grad():
        assert model(ids).logits.shape == (1, ids.shape[1], model.config.vocab_size)


def test_checkpoint_generates_in_sparsekv(trained):
    from sparsekv import LLM
    from sparsekv.sampling_params import SamplingParams

    out, _ = trained
    llm = LLM(str(out), overrides=["device=cpu", "dtype=float32", "offload=none"])
    result = llm.generate("The special magic number for amber is", SamplingParams(temperature=0, max_tokens=4,
                                                                                 ignore_eos=True))
    assert len(result[0].token_ids) == 4


def test_plan_is_seeded_held_out_and_follows_the_curriculum(train_probe, probe_data):
    argv = ["--steps", "20", "--max-len", "8192", "--min-len", "512", "--accum", "2", "--short-frac", "0",
            "--short-len", "512", "--ramp", "0.5"]  # no short phase: the ramp starts at --min-len
    args = train_probe.parse_args(argv)
    plan = probe_data.micro_plan(args)
    assert plan == probe_data.micro_plan(args) and len(plan) == 40
    assert plan != probe_data.micro_plan(train_probe.parse_args(["--seed", "1", *argv]))
    lengths = [length for length, _ in plan]
    assert lengths[:2] == [512, 512] and max(lengths[20:]) == 8192 and 8192 not in lengths[:10]
    for length, samples in plan:
        assert len(samples) == args.micro_tokens // length
        assert all(seed >= probe_data.TRAIN_SEED_BASE for _, seed in samples)


def test_short_phase_comes_first_then_the_ramp_reaches_max_len(train_probe, probe_data):
    args = train_probe.parse_args(["--steps", "40", "--max-len", "16384", "--min-len", "1024", "--short-len", "2048",
                                   "--short-frac", "0.5", "--ramp", "0.25", "--frontier-share", "1"])
    default = train_probe.parse_args([])
    assert (default.min_len, default.short_len, default.short_frac, default.ramp) == (512, 2048, 0.55, 0.2)
    assert train_probe.parse_args(["--max-len", "1024"]).short_len == 1024  # the short phase's end fits --max-len
    lengths = [length for length, _ in probe_data.micro_plan(args)]
    short, ramp, full = lengths[:80], lengths[80:120], lengths[120:]
    assert set(short) == {1024, 1536, 2048}
    assert max(ramp) < 16384 and max(ramp) > 2048
    assert min(full) >= 6144 and 16384 in full  # --frontier-share 1: the top two octaves only
    record = probe_data.plan_summary(probe_data.micro_plan(args))
    assert record.startswith("160 micro-batches") and "cost model" in record
    # the cost model: the H100 preflights' mean timings, 0.0375 s at 512 and 0.112 s at 32768
    assert probe_data.plan_seconds([(512, []), (32768, [])]) == pytest.approx(0.0375 + 0.112)


def committed_lineage() -> list[dict]:
    """The committed checkpoint's training.json and the records of the stages it continued, the first stage last."""
    record = json.loads((TOOLS.parent / "sparsekv" / "checkpoints" / "probe" / "training.json").read_text())
    lineage = [record]
    while "init_from_record" in lineage[-1]:
        lineage.append(lineage[-1]["init_from_record"])
    return lineage


def test_recipe_is_the_committed_checkpoints_run(train_probe):
    stages = train_probe.parse_args(["--recipe"]).stages
    lineage = committed_lineage()[::-1]  # the first stage first
    assert len(stages) == len(lineage) == 3
    for stage, record in zip(stages, lineage):
        for key, value in record["args"].items():
            if key not in ("device", "workers"):  # a --then stage runs with the first stage's run options
                assert getattr(stages[0] if key in train_probe.RUN_FIELDS else stage, key) == value, key
        assert record["steps_done"] == (stage.stop_step or stage.steps) and not record["stopped_early"]
    # given after --recipe, an option wins over the recipe's
    assert train_probe.parse_args(["--recipe", "--seed", "7"]).seed == 7


def test_recipe_starts_from_the_defaults(train_probe, probe_data):
    args = train_probe.parse_args([])
    first = train_probe.parse_args(["--recipe"])
    differ = {k for k, v in vars(args).items() if k != "stages" and getattr(first, k) != v}
    assert differ == {"recipe", "stop_step", "time_limit_min", "eval_samples", "then"}
    assert first.stop_step == 1120
    assert args.task_weights == probe_data.TASK_WEIGHTS and args.tasks == list(probe_data.TASK_WEIGHTS)
    plan = probe_data.micro_plan(args)
    assert len(plan) == 5200 and {length for length, _ in plan[:715 * 4]} == {512, 768, 1024, 1536, 2048}
    first_full = min(i for i, (length, _) in enumerate(plan) if length == 32768) // 4  # the ramp: 260 steps
    assert 715 + 250 <= first_full <= 715 + 265
    # the recipe's first 1,120 steps ended at 239 s on one H100 (196 s with a warm compile cache); the model: 202 s
    assert probe_data.plan_seconds(plan[:1120 * 4]) == pytest.approx(202, abs=3)


def test_cost_model_matches_the_preflights_it_was_fit_to(train_probe, probe_data):
    stages = train_probe.parse_args(["--recipe"]).stages
    plans = [probe_data.micro_plan(stage)[:(stage.stop_step or stage.steps) * stage.accum] for stage in stages]
    assert [len(plan) for plan in plans] == [4480, 2000, 1800]
    # the recipe's two preflights on one H100 estimated 442 and 463 s (docs/probe.md)
    assert 442 <= sum(probe_data.plan_seconds(plan) for plan in plans) <= 463


def test_task_weights_override_the_default_mix(train_probe):
    args = train_probe.parse_args(["--task-weights", TRIAL_WEIGHTS])
    assert args.task_weights == {"niah_single": 1.0, "niah_multikey": 2.0, "niah_multivalue": 1.0,
                                 "niah_multiquery": 1.0, "variable_tracking": 2.5, "common_words": 0.5,
                                 "kv_adjacent": 3.0}


def test_preflight_estimates_every_stage_and_names_the_one_the_time_limit_cuts(train_probe):
    plans = [[(512, [])] * 40, [(32768, [])] * 8]  # 10 and 2 steps of 4 micro-batches
    timing = dict(short=(512, 0.05), long=(32768, 0.25), accum=4)
    fits = train_probe.preflight_report(plans, budget_s=10, **timing)
    assert fits == ["a micro-batch takes 0.050 s at length 512, 0.250 s at 32768; 48 micro-batches: about 4 s of "
                    "training (2 + 2 s by stage)"]
    cut = train_probe.preflight_report(plans, budget_s=3.4, **timing)
    assert cut[1] == ("warning: 4 s exceed the 3 s --time-limit-min leaves for training; stage 2 of 2 would stop "
                      "after about 1 of its 2 steps: shorten the stages (--steps / --stop-step in each --then)")
    one = train_probe.preflight_report(plans[:1], budget_s=1.1, **timing)
    assert one[0].endswith("40 micro-batches: about 2 s of training")
    assert one[1].endswith("the run will stop early: pass --stop-step 5 (or fewer --steps)")


def test_variable_names_are_spelled_one_token_per_letter(probe_data):
    dataset = probe_data.MicroBatches([(512, [("variable_tracking", 10**9 + 2)])])
    batch = dataset[0]
    answer = dataset.tokenizer.convert_ids_to_tokens(batch["labels"][batch["answer"]].tolist())[:-1]  # no EOS
    assert len(answer) == 5 * 5 + 5 and all(len(token) == 1 for token in answer), answer  # "A B C D E , ... ."


def test_kv_adjacent_asks_every_fact_and_scores_only_the_values(probe_data):
    from sparsekv.tasks.ruler import generators

    tok = probe_data.build_probe_tokenizer()
    sample = probe_data.training_sample("kv_adjacent", tok, 512, 10**9 + 3)
    assert sample == probe_data.kv_adjacent_sample(tok, 512, 10**9 + 3) and sample.context_tokens <= 512
    prompt = tok.convert_ids_to_tokens(sample.prompt_ids)
    facts = {prompt[i - 1]: "".join(prompt[i:i + 7]) for i in range(1, len(prompt) - 7)
             if prompt[i - 1] in generators.KEYS and all(t.isdigit() for t in prompt[i:i + 7])}
    assert len(facts) == probe_data.KV_PAIRS and prompt[-1] in facts  # the last word asks one fact's key
    asked = sample.continuation.replace(".", "").split()
    assert asked[0] == facts[prompt[-1]] == sample.answers[0]
    assert dict(zip([prompt[-1], *asked[1::2]], asked[0::2])) == facts  # every fact, each key then its value
    batch = probe_data.MicroBatches([(512, [("kv_adjacent", 10**9 + 3)])], tail_weight=0.25)[0]
    labels = tok.convert_ids_to_tokens(batch["labels"].tolist())
    keys = [label in generators.KEYS for label in labels]
    assert sum(keys) == probe_data.KV_PAIRS - 1 and labels[-1] == "<eos>"
    assert all(w == 0 and not a for w, a, k in zip(batch["weights"].tolist(), batch["answer"].tolist(), keys) if k)
    assert batch["answer"].sum() == probe_data.KV_PAIRS * 8 + 1  # seven digits and "." a value, then EOS


def test_stop_step_keeps_the_schedule_of_steps(train_probe, tmp_path, capsys):
    out = tmp_path / "stopped"
    train_probe.main(["--out", str(out), "--steps", "6", "--stop-step", "2", "--workers", "0", *TOY,
                      "--eval-samples", "0"])
    log = capsys.readouterr().out
    assert [line.split()[1] for line in log.splitlines() if line.startswith("step ")] == ["1/6", "2/6"]
    assert "plan: 4 micro-batches" in log  # the two steps run (two micro-batches each), of the six planned
    record = json.loads((out / "training.json").read_text())
    assert record["steps_done"] == 2 and not record["stopped_early"] and record["args"]["stop_step"] == 2


def test_micro_batch_targets_are_the_answer_then_eos(probe_data):
    from sparsekv.tasks.ruler.generators import answer_text, make_sample

    dataset = probe_data.MicroBatches([(512, [("niah_single", 10**9 + 1), ("variable_tracking", 10**9 + 2)])])
    batch = dataset[0]
    tok = dataset.tokenizer
    width = batch["input_ids"].shape[1]
    flat = batch["input_ids"].reshape(-1)
    # each target is the token right after its position
    assert flat[batch["positions"] + 1].tolist() == batch["labels"].tolist()
    sample = make_sample("niah_single", tok, 512, 10**9 + 1)
    answer = tok.encode(answer_text(sample), add_special_tokens=False) + [tok.eos_token_id]
    first = batch["positions"][:len(answer)]
    assert batch["labels"][:len(answer)].tolist() == answer
    assert first.tolist() == list(range(len(sample.prompt_ids) - 1, len(sample.prompt_ids) - 1 + len(answer)))
    assert all(int(p) // width == 1 for p in batch["positions"][len(answer):])
    assert batch["answer"].all() and (batch["weights"] == 1).all()


def test_tail_targets_are_the_question_and_prefix_at_their_weight(probe_data):
    import probe_tokenizer

    from sparsekv.tasks.ruler.generators import PREFIX_ONE, QUESTION_ONE

    batch = probe_data.MicroBatches([(512, [("niah_multikey", 10**9 + 5)])], tail_weight=0.25)[0]
    same = probe_data.MicroBatches([(512, [("niah_multikey", 10**9 + 5)])], tail_weight=1.0)[0]
    assert same["answer"].tolist() == batch["answer"].tolist() and (same["weights"] == 1).all()
    flat = batch["input_ids"].reshape(-1)
    assert flat[batch["positions"] + 1].tolist() == batch["labels"].tolist()
    tail = batch["labels"][~batch["answer"]].tolist()
    decoded = probe_tokenizer.build_probe_tokenizer().decode(tail)
    key = decoded.split(" for ")[1].split()[0]
    assert decoded.split() == (QUESTION_ONE.format(key=key) + " " + PREFIX_ONE.format(key=key)).replace(
        "?", " ?").split()
    assert (batch["weights"][~batch["answer"]] == 0.25).all() and (batch["weights"][batch["answer"]] == 1).all()
    assert batch["answer"].sum() == 9  # seven digits, ".", EOS


def test_time_limit_stops_early_and_still_saves(train_probe, tmp_path, capsys):
    out = tmp_path / "early"
    train_probe.main(["--out", str(out), "--steps", "100000", "--workers", "0", "--time-limit-min", "0.06", *TOY])
    log = capsys.readouterr().out
    assert "stopped early at step" in log
    record = json.loads((out / "training.json").read_text())
    assert record["stopped_early"] and record["steps_done"] < 100000
    assert list(out.glob("*.safetensors"))


def test_eval_samples_zero_skips_the_check(train_probe, tmp_path, capsys):
    out = tmp_path / "no-check"
    train_probe.main(["--out", str(out), "--steps", "1", "--workers", "0", *TOY, "--eval-samples", "0"])
    log = capsys.readouterr().out
    assert "held-out accuracy" not in log and "evaluation failed" not in log
    assert "eval" not in json.loads((out / "training.json").read_text())


BAD_ARGUMENTS = [
    (["--max-len", "4096", "--micro-tokens", "1024"], "--micro-tokens 1024 is below --max-len 4096"),
    (["--short-frac", "0.7", "--ramp", "0.4"], "--short-frac 0.7 + --ramp 0.4 must lie in [0, 1]"),
    (["--short-len", "256"], "--short-len 256 must lie between --min-len 512"),
    (["--task-weights", "niah_single=1,needle=2"], "--task-weights entry 'needle=2'"),
    (["--eval-samples", "-1"], "--eval-samples -1 must be >= 0"),
    (["--steps", "10", "--stop-step", "11"], "--stop-step 11 must lie between 1 and --steps 10"),
    (["--tasks", "niah_single", "--task-weights", "niah_single=0"], "the --tasks all weigh 0"),
    (["--task-weights", "common_words=-1"], "weight >= 0"),
]


@pytest.mark.parametrize("argv, message", BAD_ARGUMENTS)
def test_bad_arguments_fail_before_training(train_probe, capsys, argv, message):
    with pytest.raises(SystemExit):
        train_probe.parse_args(argv)
    assert message in capsys.readouterr().err


def test_bad_output_or_length_fails_before_training_and_keeps_the_files(train_probe, tmp_path):
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "thesis.txt").write_text("keep me")
    with pytest.raises(SystemExit, match="not a probe checkpoint"):
        train_probe.main(["--out", str(foreign), "--steps", "1", *TOY])
    assert (foreign / "thesis.txt").read_text() == "keep me"
    with pytest.raises(SystemExit, match="--min-len 40 is too small"):
        train_probe.main(["--out", str(tmp_path / "x"), *TOY, "--min-len", "40"])


def test_a_run_records_the_digest_of_its_saved_weights_and_its_seed_repeats_it(train_probe, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    def run(name: str, seed: str) -> str:
        train_probe.main(["--out", str(tmp_path / name), "--steps", "2", "--workers", "0", *TOY, "--eval-samples", "0",
                          "--seed", seed])
        assert not torch.are_deterministic_algorithms_enabled()  # the mode ends with the run
        return json.loads((tmp_path / name / "training.json").read_text())["weights_sha256"]

    first, again, other = run("a", "3"), run("b", "3"), run("c", "4")
    assert first == again != other
    saved = AutoModelForCausalLM.from_pretrained(str(tmp_path / "a"), dtype=torch.bfloat16)
    assert train_probe.weights_digest(saved) == first


@pytest.mark.gpu
def test_cuda_training_compiles_its_layers_and_repeats_its_weights_bit_for_bit(train_probe, tmp_path, capsys):
    """On CUDA: deterministic kernels and compiled layers, lengths 256-2K (several batch shapes, one of them B=1);
    two runs of one seed, in one process, give the same digest."""
    digests = []
    for name in ("a", "b"):
        out = tmp_path / name
        train_probe.main(["--out", str(out), *TOY, "--device", "cuda", "--max-len", "2048", "--micro-tokens",
                          "2048", "--steps", "6", "--short-frac", "0", "--ramp", "0.5", "--workers", "0",
                          "--eval-samples", "0"])
        digests.append(json.loads((out / "training.json").read_text())["weights_sha256"])
    assert "preflight: a micro-batch takes" in capsys.readouterr().out
    assert digests[0] == digests[1]


def test_init_from_continues_a_checkpoint_and_records_its_lineage(train_probe, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    train_probe.main(["--out", str(first), "--steps", "1", "--workers", "0", *TOY, "--eval-samples", "0"])
    train_probe.main(["--out", str(second), "--init-from", str(first), "--steps", "1", "--workers", "0", "--hidden",
                      "999", "--layers", "9", "--max-len", "512", "--min-len", "256", "--micro-tokens", "1024",
                      "--eval-samples", "0", "--seed", "1"])
    config = json.loads((second / "config.json").read_text())
    first_config = json.loads((first / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (first_config["hidden_size"],
                                                                    first_config["num_hidden_layers"])
    record = json.loads((second / "training.json").read_text())
    assert record["args"]["init_from"] == str(first) and record["args"]["hidden"] == first_config["hidden_size"]
    assert record["init_from_record"] == json.loads((first / "training.json").read_text())


def test_init_from_refuses_a_directory_without_a_checkpoint_or_with_another_tokenizer(train_probe, tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    args = ["--out", str(tmp_path / "out"), "--steps", "1", "--workers", "0", *TOY, "--eval-samples", "0"]
    with pytest.raises(SystemExit, match="no config.json there"):
        train_probe.main([*args, "--init-from", str(tmp_path)])
    other = tmp_path / "other"
    train_probe.main(["--out", str(other), "--steps", "1", "--workers", "0", *TOY, "--eval-samples", "0"])
    words = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "amber": 1}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>").save_pretrained(str(other))
    with pytest.raises(SystemExit, match="its tokenizer differs"):
        train_probe.main([*args, "--init-from", str(other)])
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_committed_checkpoint_is_one_run_of_three_stages(train_probe):
    lineage = committed_lineage()
    first = lineage[-1]
    assert first["args"]["then"] and not any(r["args"]["init_from"] for r in lineage)  # --then stages, one run
    for record in lineage[:-1]:  # the later stages keep the first stage's shape
        assert all(record["args"][k] == first["args"][k] for k in ("hidden", "layers", "heads", "kv_heads"))
    # the stages' training time on the H100 that trained it, its compile cache warm (docs/probe.md)
    assert sum(r["train_seconds"] for r in lineage) == pytest.approx(429.4, abs=0.1)


def test_committed_weights_are_the_ones_their_record_names(train_probe):
    import torch
    from transformers import AutoModelForCausalLM

    record = committed_lineage()[0]
    model = AutoModelForCausalLM.from_pretrained(TOOLS.parent / "sparsekv" / "checkpoints" / "probe",
                                                 dtype=torch.bfloat16)
    assert train_probe.weights_digest(model) == record["weights_sha256"]


def test_then_stages_continue_the_weights_in_one_run(train_probe, tmp_path):
    out = tmp_path / "staged"
    second = "--steps 2 --seed 5 --lr 1e-4 --max-len 512 --min-len 256 --micro-tokens 1024 --accum 2 --log-every 1"
    train_probe.main(["--out", str(out), "--steps", "3", "--workers", "0", *TOY, "--eval-samples", "0",
                      "--then", second])
    record = json.loads((out / "training.json").read_text())
    first = record["init_from_record"]
    assert (record["args"]["steps"], record["args"]["seed"], record["steps_done"]) == (2, 5, 2)
    assert record["args"]["hidden"] == first["args"]["hidden"] == 64  # the first stage's shape
    assert (first["args"]["steps"], first["steps_done"], first["args"]["then"]) == (3, 3, [second])
    assert "init_from_record" not in first


def test_then_stages_refuse_whole_run_options_and_bad_values(train_probe, tmp_path, capsys):
    for text, message in (("--out x", "--out: options of the whole run"),
                          ("--layers 3 --lr 1e-4", "--layers: options of the whole run"),
                          ("--steps 0", "--then '--steps 0': error: --steps must be >= 1")):
        with pytest.raises(SystemExit):
            train_probe.parse_args(["--out", str(tmp_path / "o"), "--then", text])
        assert message in capsys.readouterr().err
