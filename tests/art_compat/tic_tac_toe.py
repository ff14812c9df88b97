"""An ART-style multi-turn program: the model plays X at tic-tac-toe against a scripted opponent,
written as ART's examples write games (`@art.retry` on the rollout, `model.delete_checkpoints()`,
`model.train(groups, config=art.TrainConfig(...))`), changed only in its imports
(`import art` -> `import art_mega as art`, `art.local` -> `art_mega.local`) and its base model
(the tiny test model, with a short game so that it runs on CPU)."""

import re

import openai

import art_mega as art
from art_mega.local import LocalBackend

LINES = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]
MAX_TURNS = 3


def render(board: list[str]) -> str:
    cells = [c if c != " " else str(i + 1) for i, c in enumerate(board)]
    return "\n".join(" ".join(cells[r * 3 : r * 3 + 3]) for r in range(3))


def winner(board: list[str]) -> str | None:
    for a, b, c in LINES:
        if board[a] != " " and board[a] == board[b] == board[c]:
            return board[a]
    return None


def opponent_move(board: list[str]) -> int:
    """The scripted opponent: the centre if free, else the first free cell."""
    return 4 if board[4] == " " else board.index(" ")


@art.retry(max_attempts=3, exceptions=(openai.APIConnectionError,))
async def rollout(model: art.TrainableModel, game: int) -> art.Trajectory:
    client = model.openai_client()
    board = [" "] * 9
    trajectory = art.Trajectory(
        messages_and_choices=[
            {"role": "system", "content": "You play X at tic-tac-toe. Reply with the number of a free cell."}
        ],
        reward=0.0,
        metadata={"game": game},
    )
    moves = 0
    for _ in range(MAX_TURNS):
        trajectory.messages_and_choices.append({"role": "user", "content": render(board)})
        completion = await client.chat.completions.create(
            model=model.get_inference_name(),
            messages=trajectory.messages(),
            max_completion_tokens=4,
        )
        choice = completion.choices[0]
        trajectory.messages_and_choices.append(choice)
        content = choice.message.content or ""
        digit = re.search(r"[1-9]", content)
        cell = int(digit.group()) - 1 if digit else None
        if cell is None or board[cell] != " ":
            trajectory.reward = -1.0 + 0.25 * moves + len(content) / 100  # an illegal move ends the game
            break
        board[cell] = "X"
        moves += 1
        if winner(board) == "X":
            trajectory.reward = 1.0
            break
        board[opponent_move(board)] = "O"
        if winner(board) == "O":
            trajectory.reward = -0.5
            break
    else:
        trajectory.reward = 0.25 * moves
    trajectory.metrics["moves"] = moves
    return trajectory


async def main(base_model: str = "tiny-llama", steps: int = 2) -> tuple[list[int], list[int]]:
    backend = LocalBackend(seq_len=256, max_model_len=256)
    model = art.TrainableModel(name="ttt-001", project="tic-tac-toe", base_model=base_model)
    await model.register(backend)
    seen = []
    try:
        for _ in range(await model.get_step(), steps):
            train_groups = await art.gather_trajectory_groups(
                (art.TrajectoryGroup(rollout(model, game) for _ in range(4)) for game in range(2)),
                pbar_desc="gather",
            )
            await model.delete_checkpoints()
            await model.train(train_groups, config=art.TrainConfig(learning_rate=1e-4))
            seen.append(await model.get_step())
        deleted = await model.delete_checkpoints()  # keep only the latest (no val/reward logged)
    finally:
        await backend.close()
    return seen, deleted
