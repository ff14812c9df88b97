"""A format-primed SmolLM2-135M-Instruct for the upstream programs whose rewards need an exact
answer format (the 2048 and Temporal Clue notebooks).

Why: untouched, SmolLM2-135M-Instruct answers neither notebook in its format (measured: 36 of 36
2048 games end on an invalid `<move>` at the first turn, reward -1; every Temporal Clue answer
scores 0), so every group's rewards are equal and GRPO trains nothing (ART drops zero-variance
groups too). The issue allows "SmolLM2-135M or a tiny model"; ART programs may name a local model
folder as `base_model`. This module builds that folder: SmolLM2-135M-Instruct after a short
supervised fine-tune on prompts rendered by the programs' own code, so the programs themselves
stay unchanged but for the model name.

The examples (`examples`), all from `RECIPE["seed"]`:
- 2048: games generated and rendered by the notebook's own functions (`generate_game`,
  `render_board`, `apply_agent_move`, ... taken from tests/art_compat/upstream/art_2048.py with
  `ast`) after its system prompt, each assistant turn `<move>left</move>` or `<move>right</move>`
  drawn 50/50. A left/right game fills the board in 30 moves on average (max 45 of 200 simulated),
  1,600 chat-template tokens (max 2,553), well inside the notebook's max_seq_length 8192; its
  reward then varies with the board (max and total tile value), so groups have variance.
  Conversations of 1 to `max_turns` turns, the loss on every assistant turn.
- Temporal Clue: the prompts of the local puzzles.json's validation and test slices
  (`puzzles[:128]`; the notebook trains on `puzzles[128:]`), each answered "A. <name>\nB. <room>
  \nC. <hour>" with a guest, room and hour drawn from those the prompt names (not the solution):
  the format is taught, the answers stay guesses, so rewards vary within a group.

Training (`build_primed_model`): plain transformers + torch on CPU, float32, AdamW on the top
`RECIPE["trained_layers"]` decoder layers and the final norm only; everything below is frozen, so
each example's input to the first trained layer is computed once (no grad) and the epochs run only
the trained layers, with logits taken only at the answer tokens (the tied 49152-row head is the
costliest matmul): 6,731 tokens forward once, then `epochs` passes over 2 layers.

The folder is cached at `<cache>/primed/SmolLM2-135M-Instruct-<hash>` (`recipe_hash`); written to a temp dir and renamed, so a
concurrent or interrupted build never leaves a half folder. `primed.json` in it records the recipe,
the per-epoch answer-token loss and the build's wall time.
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
    "version": 1,  # raise on any change to the examples or the training below
    "seed": 0,
    "games_2048": 12,
    "max_turns": 8,
    "clue_prompts": 12,
    "trained_layers": 2,
    "epochs": 8,
    "learning_rate": 1e-4,
    "moves": ["left", "right"],
}
NAME = "SmolLM2-135M-Instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def program_functions(path: Path, names: set[str]) -> dict[str, Any]:
    """The top-level functions `names` of the program at `path` (and every top-level
    `import random` / `import string` / `import xml...` and assignment of a constant they use),
    defined in a fresh namespace without running the program's other cells."""
    tree = ast.parse(path.read_text())
    body: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            body.append(node)
        elif isinstance(node, ast.Import) and all(
            a.name in {"random", "string", "xml.etree.ElementTree"} for a in node.names
        ):
            body.append(node)
        elif isinstance(node, ast.ImportFrom) and node.module == "typing":
            body.append(node)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            body.append(node)
    namespace: dict[str, Any] = {}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)
    missing = names - namespace.keys()
    assert not missing, f"{path.name} defines no {sorted(missing)}"
    return namespace


def system_prompt_2048() -> str:
    """The 2048 notebook's system message, read from its `rollout` (the one string literal after
    `"role": "system"`)."""
    for node in ast.walk(ast.parse((UPSTREAM / "art_2048.py").read_text())):
        if isinstance(node, ast.Dict):
            pairs = {k.value: v for k, v in zip(node.keys, node.values) if isinstance(k, ast.Constant)}
            role, content = pairs.get("role"), pairs.get("content")
            if (
                isinstance(role, ast.Constant)
                and role.value == "system"
                and isinstance(content, ast.Constant)
            ):
                return content.value
    raise AssertionError("art_2048.py has no system message")


def _games_2048(rng: random.Random) -> list[list[dict[str, str]]]:
    game_fns = program_functions(
        UPSTREAM / "art_2048.py",
        {
            "populate_random_cell",
            "generate_game",
            "render_board",
            "condense_sequence",
            "condense_board",
            "apply_agent_move",
            "max_cell_value",
            "check_game_finished",
        },
    )
    system = system_prompt_2048()
    conversations = []
    state = random.getstate()  # the notebook's functions draw from the global `random`
    random.seed(rng.random())
    try:
        for _ in range(RECIPE["games_2048"]):
            game = game_fns["generate_game"]()
            messages = [{"role": "system", "content": system}]
            for _ in range(rng.randint(1, RECIPE["max_turns"])):
                move = f"<move>{rng.choice(RECIPE['moves'])}</move>"
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


def examples() -> list[list[dict[str, str]]]:
    """The fine-tune's conversations (see the module docstring), 2048's first."""
    rng = random.Random(RECIPE["seed"])
    return _games_2048(rng) + _clue_answers(rng)


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


def recipe_hash(base_dir: Path) -> str:
    """12 hex digits of SHA-256 over `RECIPE` (its "version" included) and the base model's
    config.json."""
    digest = hashlib.sha256(json.dumps(RECIPE, sort_keys=True).encode())
    digest.update((base_dir / "config.json").read_bytes())
    return digest.hexdigest()[:12]


def build_primed_model(base_dir: Path, cache_root: Path) -> Path:
    """Return the primed model's HF folder (model.safetensors, config, tokenizer, chat template),
    building it from `base_dir` (SmolLM2-135M-Instruct's HF folder) on first use; see the module
    docstring. Measured: 694 s on 2 CPU cores shared with a CI run (answer-token loss 0.95 -> 0.12
    over the 8 epochs); ~2 GiB of memory."""
    out = cache_root / "primed" / f"{NAME}-{recipe_hash(base_dir)}"
    if (out / "primed.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    torch.manual_seed(RECIPE["seed"])
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model.eval()  # no dropout; the fine-tune is deterministic given the seed
    inner = model.model
    first = len(inner.layers) - RECIPE["trained_layers"]
    trained = [p for layer in inner.layers[first:] for p in layer.parameters()] + list(
        inner.norm.parameters()
    )
    for p in model.parameters():
        p.requires_grad_(False)
    for p in trained:
        p.requires_grad_(True)
    cached = []
    with torch.no_grad():
        for messages in examples():
            ids, answer = _tokenize(tokenizer, messages)
            input_ids = torch.tensor([ids])
            hidden = inner(input_ids=input_ids, output_hidden_states=True).hidden_states[first]
            cached.append(
                (hidden, torch.tensor([i - 1 for i in answer]), torch.tensor([ids[i] for i in answer]))
            )
    optimizer = torch.optim.AdamW(trained, lr=RECIPE["learning_rate"], weight_decay=0.0)
    losses = []
    for _ in range(RECIPE["epochs"]):
        total = 0.0
        for hidden, positions, targets in cached:
            h = hidden
            position_ids = torch.arange(h.shape[1])[None]
            rotary = inner.rotary_emb(h, position_ids)
            for layer in inner.layers[first:]:
                h = layer(h, attention_mask=None, position_ids=position_ids, position_embeddings=rotary)
            logits = model.lm_head(inner.norm(h)[0, positions])
            loss = torch.nn.functional.cross_entropy(logits, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            total += loss.item()
        losses.append(round(total / len(cached), 4))
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        for name in TOKENIZER_FILES:
            if (base_dir / name).is_file():
                shutil.copy2(base_dir / name, staging / name)
        record = {
            "recipe": RECIPE,
            "base": str(base_dir),
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
