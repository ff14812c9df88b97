"""Every option of ART's `dev.TrainConfig` / `types.TrainConfig` / `LocalBackend.train` (openpipe-art
0.5.18) either acts as in ART, pinned here against values computed by hand on small tensors, or
is refused with its sentence; an unknown option is refused; ART's defaults (CISPO, epsilon 1.0 /
4.0) are what `backend.train` sends."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the trainer's losses need torch (the cpu extra)")

import art_mega as art  # noqa: E402
from art_mega.backend import (  # noqa: E402
    ART_OPTION_HINTS,
    MegatronBackend,
    check_grpo_options,
    trajectories_learning_rate,
)
from art_mega.dev.train import TRAIN_CONFIG_KEYS  # noqa: E402
from art_mega.errors import HyperParameterError, UserError  # noqa: E402
from art_mega.model import dev_train_options  # noqa: E402
from art_mega.trainer.batch import Document  # noqa: E402
from art_mega.trainer.prepare.tokenize import balance_advantages  # noqa: E402
from art_mega.trainer.protocol import GRPOLossConfig  # noqa: E402
from art_mega.trainer.rank.loss import grpo_loss  # noqa: E402

L = math.log


def t(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


MASK = t([0.0, 1.0, 1.0])
OLD = t([0.0, L(0.5), L(0.5)])
A = torch.tensor([1.0], dtype=torch.float64)


def new(p1: float, p2: float) -> torch.Tensor:
    """Policy logprobs whose ratios to OLD are 2 p1 and 2 p2."""
    return t([0.0, L(p1), L(p2)]).requires_grad_(True)


def loss_of(config: GRPOLossConfig, logprobs: torch.Tensor | None = None, adv: torch.Tensor = A, **kw: Any):
    return grpo_loss(new(0.6, 0.3) if logprobs is None else logprobs, OLD, adv, MASK, config=config, **kw)


# ------------------------------------------------------------------ objectives and their defaults


def test_cispo_is_the_default_with_epsilon_1_and_4() -> None:
    """ART's default objective: l_t = -clip(sg[r_t], 1 - 1.0, 1 + 4.0) A new_t."""
    _, loss = check_grpo_options(**BASE)
    assert (loss["loss_fn"], loss["epsilon_low"], loss["epsilon_high"]) == ("cispo", 1.0, 4.0)
    logprobs = new(0.6, 0.3)  # ratios 1.2 and 0.6, inside [0, 5]
    out = grpo_loss(logprobs, OLD, A, MASK, config=GRPOLossConfig(**loss))
    assert out.loss.item() == pytest.approx(-(1.2 * L(0.6) + 0.6 * L(0.3)) / 2, abs=1e-12)
    out.loss.backward()
    # d/d new_t = -r_t A / 2, the ratio carrying no gradient
    assert logprobs.grad.tolist()[0] == pytest.approx([0.0, -0.6, -0.3], abs=1e-12)


def test_cispo_clips_the_weight_not_the_gradient() -> None:
    old = t([0.0, L(0.1), L(0.5)])
    logprobs = new(0.6, 0.3)  # ratios 6 (clipped to 5) and 0.6
    out = grpo_loss(
        logprobs, old, A, MASK, config=GRPOLossConfig(loss_fn="cispo", epsilon_low=1.0, epsilon_high=4.0)
    )
    assert out.loss.item() == pytest.approx(-(5 * L(0.6) + 0.6 * L(0.3)) / 2, abs=1e-12)
    out.loss.backward()
    assert logprobs.grad.tolist()[0] == pytest.approx([0.0, -2.5, -0.3], abs=1e-12)


def test_ppo_defaults_are_0_2_and_epsilon_high_follows_epsilon() -> None:
    _, loss = check_grpo_options(**{**BASE, "loss_fn": "ppo"})
    assert (loss["loss_fn"], loss["epsilon_low"], loss["epsilon_high"]) == ("ppo", 0.2, None)
    # ratios 1.2 and 0.6, A=+1: min(1.2, 1.2) and min(0.6, 0.8) -> -(1.8)/2
    assert loss_of(GRPOLossConfig(**loss)).loss.item() == pytest.approx(-0.9)
    # ART: epsilon set, epsilon_high unset -> cispo keeps 4.0, ppo follows epsilon
    _, loss = check_grpo_options(**{**BASE, "epsilon": 0.5})
    assert (loss["epsilon_low"], loss["epsilon_high"]) == (0.5, 4.0)
    _, loss = check_grpo_options(**{**BASE, "loss_fn": "ppo", "epsilon": 0.3})
    assert (loss["epsilon_low"], loss["epsilon_high"]) == (0.3, None)


def test_epsilon_none_takes_the_default_and_reaches_a_valid_job(backend: MegatronBackend) -> None:
    """`epsilon=None` crashed a rank with a TypeError; it is ART's "default for loss_fn"."""
    job = train(backend, TRAINABLE, epsilon=None, epsilon_high=None)
    settings = GRPOLossConfig(**job["loss"])  # what the rank receives (jobs.run_train_job)
    assert (settings.epsilon_low, settings.epsilon_high) == (1.0, 4.0)
    with pytest.raises(
        HyperParameterError, match=r"backend.train\(loss_fn='reinforce'\) must be one of 'ppo', 'cispo'"
    ):
        train(backend, TRAINABLE, loss_fn="reinforce")


# ------------------------------------------------------------------ ratios


def test_importance_sampling_average_and_geometric_average() -> None:
    s = math.sqrt(1.2 * 0.6)  # the sequence ratio exp(mean(ln 1.2, ln 0.6))
    ppo = dict(loss_fn="ppo", epsilon_low=0.2)
    # average: (1.2 + s)/2 = 1.0243 (inside), (0.6 + s)/2 = 0.7243 (below 0.8: min keeps it)
    logprobs = new(0.6, 0.3)
    out = loss_of(GRPOLossConfig(importance_sampling_level="average", **ppo), logprobs)
    assert out.loss.item() == pytest.approx(-((1.2 + s) / 2 + (0.6 + s) / 2) / 2, abs=1e-12)
    out.loss.backward()
    # d r_1 / d new_1 = (1.2 + s/2)/2, d r_2 / d new_1 = (s/2)/2 (the mean's gradient, as in ART)
    assert logprobs.grad[0, 1].item() == pytest.approx(-((1.2 + s / 2) / 2 + (s / 2) / 2) / 2, abs=1e-12)
    out = loss_of(GRPOLossConfig(importance_sampling_level="geometric_average", **ppo))
    assert out.loss.item() == pytest.approx(-(math.sqrt(1.2 * s) + math.sqrt(0.6 * s)) / 2, abs=1e-12)
    out = loss_of(GRPOLossConfig(importance_sampling_level="sequence", **ppo))
    assert out.loss.item() == pytest.approx(-s, abs=1e-12)
    with pytest.raises(HyperParameterError, match="must be 'token' or 'sequence' .GSPO., or ART's 'average'"):
        check_grpo_options(**{**BASE, "importance_sampling_level": "geometric"})


def test_mask_prob_ratio_zeroes_ratios_outside_the_clip_range() -> None:
    # ratios 1.1 (inside (0.8, 1.2): kept) and 0.6 (outside: 0); A=+1 -> -(1.1 + min(0, 0.8))/2
    out = loss_of(GRPOLossConfig(loss_fn="ppo", mask_prob_ratio=True), new(0.55, 0.3))
    assert out.loss.item() == pytest.approx(-0.55, abs=1e-12)
    # a ratio on the bound (1.2) is outside too: both zero
    assert loss_of(GRPOLossConfig(loss_fn="ppo", mask_prob_ratio=True)).loss.item() == pytest.approx(0.0)


def test_max_negative_advantage_importance_sampling_weight_caps_every_ratio() -> None:
    config = GRPOLossConfig(loss_fn="ppo", max_negative_advantage_importance_sampling_weight=1.0)
    # ratio 1.2 -> 1.0; A=-1: min(-1.0, -1.0) and min(-0.6, -0.8) -> (1.0 + 0.8)/2
    assert loss_of(config, adv=-A).loss.item() == pytest.approx(0.9, abs=1e-12)
    # ART caps whatever the advantage's sign: A=+1 -> -(1.0 + 0.6)/2
    assert loss_of(config).loss.item() == pytest.approx(-0.8, abs=1e-12)


def test_kimi_k2_tau_shifts_the_advantage_by_the_log_ratio() -> None:
    tau = 0.5
    a1, a2 = 1 - tau * L(1.2), 1 - tau * L(0.6)  # 0.9088 and 1.2554, both > 0
    out = loss_of(GRPOLossConfig(loss_fn="ppo", kimi_k2_tau=tau))
    assert out.loss.item() == pytest.approx(-(1.2 * a1 + 0.6 * a2) / 2, abs=1e-12)


def test_truncated_importance_sampling_caps_the_loss_ratio_or_the_inference_ratio() -> None:
    # without inference logprobs ART weighs by min(r, C): ratios 1.2 -> 1.1 and 0.6
    out = loss_of(GRPOLossConfig(loss_fn="ppo", truncated_importance_sampling=1.1))
    assert out.loss.item() == pytest.approx(-(1.2 * 1.1 + 0.6 * 0.6) / 2, abs=1e-12)
    # with them (precalculate_logprobs): min(exp(old - inference), C) = min(2, 1.5) and 1
    inference = t([0.0, L(0.25), L(0.5)])
    config = GRPOLossConfig(loss_fn="ppo", truncated_importance_sampling=1.5, precalculate_logprobs=True)
    out = loss_of(config, inference_logprobs=inference)
    assert out.loss.item() == pytest.approx(-(1.5 * 1.2 + 0.6) / 2, abs=1e-12)
    assert config.recomputes_old and GRPOLossConfig(tis_cap=2.0).recomputes_old
    assert not GRPOLossConfig(truncated_importance_sampling=2.0).recomputes_old
    with pytest.raises(
        HyperParameterError, match=r"tis_cap=2.0\) and truncated_importance_sampling=2.0 are two TIS caps"
    ):
        check_grpo_options(**{**BASE, "tis_cap": 2.0, "truncated_importance_sampling": 2.0})


def test_kl_penalty_coef_shapes_advantages_and_is_not_the_k3_term() -> None:
    ref = t([0.0, L(0.5), L(0.5)])
    kl1, kl2 = L(0.6 / 0.5), L(0.3 / 0.5)  # new - ref per token
    mean = (kl1 + kl2) / (2 + 1e-6)
    a1, a2 = 1 + 0.1 * (mean - kl1), 1 + 0.1 * (mean - kl2)
    config = GRPOLossConfig(loss_fn="ppo", kl_penalty_coef=0.1)
    assert config.needs_reference and not GRPOLossConfig().needs_reference
    out = loss_of(config, ref_logprobs=ref)
    assert out.loss.item() == pytest.approx(-(1.2 * a1 + 0.6 * a2) / 2, abs=1e-12)
    assert out.kl_policy_ref == pytest.approx(mean, abs=1e-12)
    # art-mega's k3 term is kl_beta, a different loss: -0.9 + 0.1 * mean k3
    k3 = loss_of(GRPOLossConfig(loss_fn="ppo", kl_beta=0.1), ref_logprobs=ref)
    assert k3.loss.item() == pytest.approx(-0.9 + 0.1 * 0.0857483, abs=1e-6) and k3.kl_policy_ref is None
    _, loss = check_grpo_options(**{**BASE, "kl_penalty_coef": 0.1})
    assert (loss["kl_penalty_coef"], loss["kl_beta"]) == (0.1, 0.0)
    _, loss = check_grpo_options(**{**BASE, "config": art.TrainConfig(kl_penalty_coef=0.2)})
    assert (loss["kl_penalty_coef"], loss["kl_beta"]) == (0.2, 0.0)
    with pytest.raises(
        HyperParameterError, match=r"kl_penalty_coef=0.3\) disagrees with config.kl_penalty_coef=0.2"
    ):
        check_grpo_options(**{**BASE, "kl_penalty_coef": 0.3, "config": art.TrainConfig(kl_penalty_coef=0.2)})


# ------------------------------------------------------------------ advantages and learning rate


def doc(advantage: float, tokens: int) -> Document:
    return Document([1] * (tokens + 1), [0.0] + [1.0] * tokens, [0.0] * (tokens + 1), advantage, 1.0 / tokens)


def test_advantages_are_balanced_then_divided_by_their_mean_magnitude() -> None:
    docs = [doc(1.0, 2), doc(-1.0, 5), doc(0.5, 1), doc(-0.5, 3)]
    # balance 0: mean |A| over trajectories = 0.75 -> A / 0.75
    assert [d.advantage for d in balance_advantages(docs)] == pytest.approx([4 / 3, -4 / 3, 2 / 3, -2 / 3])
    # balance 0.5: negatives halved -> 1, -0.5, 0.5, -0.25; mean |A| = 0.5625
    shaped = balance_advantages(docs, 0.5)
    assert [d.advantage for d in shaped] == pytest.approx(
        [1 / 0.5625, -0.5 / 0.5625, 0.5 / 0.5625, -0.25 / 0.5625]
    )
    # balance -1: only negative advantages train: 0, -1, 0, -0.5; mean |A| = 0.375
    assert [d.advantage for d in balance_advantages(docs, -1.0)] == pytest.approx(
        [0.0, -1 / 0.375, 0.0, -0.5 / 0.375]
    )
    assert [d.advantage for d in balance_advantages([doc(1.0, 2)], 1.0)] == [1.0]
    assert [d.advantage for d in balance_advantages([doc(-1.0, 2)], 1.0)] == [0.0]  # nothing to scale
    with pytest.raises(HyperParameterError, match=r"advantage_balance=1.5\) must be a number from -1 to 1"):
        check_grpo_options(**{**BASE, "advantage_balance": 1.5})


def test_scale_rewards_and_normalize_advantages_reach_the_documents(backend: MegatronBackend) -> None:
    groups = [
        art.TrajectoryGroup([plain(2.0), plain(0.0)]),  # A = +-1 (std 1), +-1 unscaled
        art.TrajectoryGroup([plain(0.5), plain(0.0)]),  # A = +-1 (std 0.25), +-0.25 unscaled
    ]
    scaled = [d.advantage for d in train(backend, groups, allow_training_without_logprobs=True)["documents"]]
    assert scaled == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-5)
    # unscaled: +-1 and +-0.25, mean magnitude 0.625 -> +-1.6 and +-0.4
    for options in ({"scale_rewards": False}, {"normalize_advantages": False}):
        job = train(backend, groups, allow_training_without_logprobs=True, **options)
        assert [d.advantage for d in job["documents"]] == pytest.approx([1.6, -1.6, 0.4, -0.4])
    job = train(backend, groups, allow_training_without_logprobs=True, advantage_balance=1.0)
    assert [d.advantage for d in job["documents"]] == pytest.approx([2.0, 0.0, 2.0, 0.0], abs=1e-5)


def test_num_trajectories_learning_rate_multiplier_power(backend: MegatronBackend) -> None:
    assert trajectories_learning_rate(1e-5, 4, 0.5) == pytest.approx(2e-5)
    assert trajectories_learning_rate(1e-5, 4, -1.0) == pytest.approx(2.5e-6)
    assert trajectories_learning_rate(1e-5, 0, 2.0) == 1e-5  # nothing trained
    groups = [art.TrajectoryGroup([plain(1.0), plain(0.0), plain(0.5), plain(0.25)])]
    job = train(
        backend,
        groups,
        allow_training_without_logprobs=True,
        learning_rate=1e-5,
        num_trajectories_learning_rate_multiplier_power=0.5,
    )
    assert len(job["documents"]) == 4 and job["learning_rate"] == pytest.approx(2e-5)
    with pytest.raises(HyperParameterError, match="makes the learning rate 5e-06 \\* 4 \\*\\* 1000.0 = inf"):
        train(
            backend,
            groups,
            allow_training_without_logprobs=True,
            num_trajectories_learning_rate_multiplier_power=1000.0,
        )


# ------------------------------------------------------------------ refused and unknown


REFUSED = {
    "loss_fn_config": {"clip": 0.1},
    "adam_params": {"beta1": 0.9},
    "scale_learning_rate_by_reward_std_dev": True,
    "plot_tensors": True,
    "save_checkpoint": False,
    "verbose": True,
    "moe_routing_replay_bundle": object(),
    "moe_routing_replay_path": "/replay",
    "moe_routing_replay_strict": True,
    "ppo": True,
    "kl_penalty_step_lag": 2,
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_an_art_option_art_mega_does_not_implement_is_refused_with_its_sentence(
    backend: MegatronBackend, name: str
) -> None:
    value = REFUSED[name]
    with pytest.raises(HyperParameterError) as info:
        train(backend, TRAINABLE, **{name: value})
    assert str(info.value) == f"backend.train got ART's {name}={value!r}; {ART_OPTION_HINTS[name].why}"
    assert info.value.name == name


@pytest.mark.parametrize("name", sorted(n for n, r in ART_OPTION_HINTS.items() if r.off))
def test_an_unimplemented_option_at_its_off_value_does_what_art_does(
    backend: MegatronBackend, name: str
) -> None:
    assert train(backend, TRAINABLE, **{name: ART_OPTION_HINTS[name].off[0]})["documents"]


def test_every_art_option_is_implemented_or_refused() -> None:
    """ART 0.5.18's and 0.5.23's dev.TrainConfig keys, types.TrainConfig fields and
    LocalBackend.train keywords, each one a backend.train keyword or a row of ART_OPTION_HINTS."""
    from art_mega.backend import GRPO_OPTIONS

    local_backend_train = {
        "learning_rate", "loss_fn", "loss_fn_config", "normalize_advantages", "adam_params",
        "kl_penalty_coef", "kl_penalty_reference_step", "kl_ref_adapter_path", "epsilon",
        "epsilon_high", "advantage_balance", "scale_rewards", "importance_sampling_level",
        "max_negative_advantage_importance_sampling_weight", "mask_prob_ratio", "kimi_k2_tau",
        "precalculate_logprobs", "allow_training_without_logprobs", "plot_tensors",
        "truncated_importance_sampling", "scale_learning_rate_by_reward_std_dev",
        "logprob_calculation_chunk_size", "packed_sequence_length",
        "num_trajectories_learning_rate_multiplier_power", "save_checkpoint", "verbose",
    }  # fmt: skip
    local_backend_train |= {"kl_penalty_source", "optimizer_save_interval", "final_training_step"}  # 0.5.23
    train_config = {
        "learning_rate", "kl_penalty_coef", "grad_accumulation_sequences",
        "kl_penalty_source", "optimizer_save_interval", "final_training_step",  # 0.5.23
    }  # fmt: skip
    dev_keys = {"loss_fn" if k == "ppo" else k for k in TRAIN_CONFIG_KEYS}
    handled = set(GRPO_OPTIONS) | set(ART_OPTION_HINTS)
    assert (local_backend_train | dev_keys | train_config | {"ppo"}) - handled == set()
    assert set(art.TrainConfig.model_fields) == train_config | {"beta"}


def test_an_unknown_option_is_refused(backend: MegatronBackend) -> None:
    with pytest.raises(
        HyperParameterError, match=r"^backend.train got an unknown keyword epsilon_hi=0.3; use one of"
    ):
        train(backend, TRAINABLE, epsilon_hi=0.3)
    with pytest.raises(
        HyperParameterError, match="has the key 'epsilon_hi', which ART's dev.TrainConfig does not have"
    ):
        dev_train_options({"epsilon_hi": 0.3}, {})


@pytest.mark.parametrize(
    ("name", "value", "why"),
    [
        ("kl_penalty_coef", -0.1, "must be a finite number of at least 0 (negative)"),
        ("truncated_importance_sampling", 0.0, "must be a finite number greater than 0 (not above 0)"),
        (
            "max_negative_advantage_importance_sampling_weight",
            math.inf,
            "must be a finite number greater than 0 (not finite)",
        ),
        ("kimi_k2_tau", "0.1", "must be a finite number of at least 0 (a str)"),
        ("advantage_balance", math.nan, "must be a number from -1 to 1 (not finite)"),
        ("num_trajectories_learning_rate_multiplier_power", None, "must be a finite number (a NoneType)"),
        ("mask_prob_ratio", 1, "must be True or False (a int)"),
        ("precalculate_logprobs", "yes", "must be True or False (a str)"),
        ("normalize_advantages", None, "must be True or False (a NoneType)"),
        ("epsilon", "0.2", "must be a finite number of at least 0 (a str)"),
    ],
)
def test_bad_values_of_art_options_are_refused_at_the_edge(name: str, value: Any, why: str) -> None:
    with pytest.raises(HyperParameterError) as info:
        check_grpo_options(**{**BASE, name: value})
    assert str(info.value).startswith(f"backend.train({name}={value!r}) {why}; pass e.g. {name}=")


# ------------------------------------------------------------------ model.train(_config=dev.TrainConfig)


def test_dev_train_config_maps_to_backend_keywords(backend: MegatronBackend) -> None:
    assert dev_train_options({"ppo": True, "epsilon": 0.3}, {}) == {"loss_fn": "ppo", "epsilon": 0.3}
    assert dev_train_options({"ppo": False}, {}) == {"loss_fn": "cispo"}
    # ART reads an explicit epsilon_high None as "epsilon" (build_rl_train_configs omits it instead)
    assert dev_train_options({"epsilon_high": None}, {}) == {"epsilon_high": 1.0}
    assert dev_train_options({"ppo": True, "epsilon_high": None}, {}) == {
        "loss_fn": "ppo",
        "epsilon_high": 0.2,
    }
    with pytest.raises(HyperParameterError, match=r"\['ppo'\]=1 must be True or False"):
        dev_train_options({"ppo": 1}, {})
    with pytest.raises(HyperParameterError, match="sets 'epsilon' and model.train got epsilon= too"):
        dev_train_options({"epsilon": 0.3}, {"epsilon": 0.2})
    with pytest.raises(HyperParameterError, match="must be ART's dev.TrainConfig .a dict."):
        dev_train_options([("ppo", True)], {})
    model = backend._model
    model._backend = backend
    job = asyncio.run(
        model.train(
            TRAINABLE,
            config=art.TrainConfig(learning_rate=2e-6, kl_penalty_coef=0.05),
            _config={"ppo": True, "importance_sampling_level": "average", "mask_prob_ratio": True},
        )
    )
    assert job["learning_rate"] == 2e-6
    assert {
        k: job["loss"][k]
        for k in ("loss_fn", "importance_sampling_level", "mask_prob_ratio", "kl_penalty_coef")
    } == {
        "loss_fn": "ppo",
        "importance_sampling_level": "average",
        "mask_prob_ratio": True,
        "kl_penalty_coef": 0.05,
    }
    with pytest.raises(HyperParameterError, match="got ART's plot_tensors=True"):
        asyncio.run(model.train(TRAINABLE, _config={"plot_tensors": True}))


# ------------------------------------------------------------------ fixtures


BASE: dict[str, Any] = dict(
    learning_rate=5e-6,
    importance_sampling_level="token",
    epsilon=None,
    epsilon_high=None,
    kl_beta=0.0,
    tis_cap=None,
    scale_rewards=True,
    config=None,
    allow_stale=False,
    drop_nonfinite_rewards=False,
    unknown={},
)


def plain(reward: float) -> art.Trajectory:
    return art.Trajectory(
        messages_and_choices=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
        reward=reward,
    )


TRAINABLE = [art.TrajectoryGroup([plain(1.0), plain(0.0)])]


@pytest.fixture
def backend(tiny_llama_dir) -> MegatronBackend:  # noqa: ANN001
    """The tiny model registered in name only; `_step_with` returns what would be trained."""
    backend = MegatronBackend()
    backend._model = art.TrainableModel(name="m", project="p", base_model="tiny")
    backend._model_dir = tiny_llama_dir

    async def step_with(steps, metrics, kind, learning_rate, loss, started, **packing):  # noqa: ANN001
        # an rl step is one document list and one rate (`_step_with` also takes SFT's several)
        documents = steps[0] if steps and isinstance(steps[0], list) else steps
        rate = learning_rate[0] if isinstance(learning_rate, list) else learning_rate
        return {"documents": documents, "learning_rate": rate, "loss": loss}

    backend._step_with = step_with  # type: ignore[method-assign]
    return backend


def train(backend: MegatronBackend, groups: Any, **options: Any) -> Any:
    options = {"allow_training_without_logprobs": True, **options}
    return asyncio.run(backend.train(backend._model, groups, **options))


def test_kl_penalty_mean_is_per_packed_row() -> None:
    """ART takes mean_kl per packed sequence; art-mega per packed row, whatever the microbatches."""
    new = t([-1.0, -2.0], [-1.0, -3.0], [-0.5, -0.5])
    ref = t([-1.5, -1.5], [-1.5, -1.5], [-1.0, -1.0])
    mask = torch.ones(3, 2, dtype=torch.float64)
    adv = torch.ones(3, dtype=torch.float64)
    config = GRPOLossConfig(loss_fn="ppo", kl_penalty_coef=1.0)
    # rows: sequences 0 and 1 share row 0 (kl 0.5, -0.5, 0.5, -1.5: mean -0.25), sequence 2 is row 1 (mean 0.5)
    out = grpo_loss(
        new, new.detach(), adv, mask, config=config, ref_logprobs=ref, packed_rows=torch.tensor([0, 0, 1])
    )
    shaped = [1 + (-0.25 - 0.5), 1 + (-0.25 + 0.5), 1 + (-0.25 - 0.5), 1 + (-0.25 + 1.5), 1.0, 1.0]
    assert out.loss.item() == pytest.approx(-sum(shaped) / 6, abs=1e-6)  # every ratio 1
    assert out.kl_policy_ref == pytest.approx((0.5 - 0.5 + 0.5 - 1.5 + 0.5 + 0.5) / 6, abs=1e-6)


def test_the_optimizer_follows_art_and_trainer_args_set_it() -> None:
    from art_mega.backend import art_optimizer

    optimizer, decay, clip = art_optimizer({})
    assert (optimizer.beta1, optimizer.beta2, optimizer.eps) == (0.9, 0.99, 1e-8)
    assert (optimizer.weight_decay, optimizer.clip_grad) == (0.0, 1.0)  # ART's SFT steps
    assert (decay, clip) == (0.1, 0.1)  # ART's RL steps
    optimizer, decay, clip = art_optimizer(
        {
            "adam_beta1": 0.8,
            "adam_beta2": 0.95,
            "adam_epsilon": 1e-6,
            "weight_decay": 0.0,
            "max_grad_norm": 1.0,
        }
    )
    assert (optimizer.beta1, optimizer.beta2, optimizer.eps, decay, clip) == (0.8, 0.95, 1e-6, 0.0, 1.0)
    with pytest.raises(
        HyperParameterError, match=r"trainer_args\)\(adam_beta2=1.0\) must be a number from 0 to"
    ):
        art_optimizer({"adam_beta2": 1.0})
    with pytest.raises(
        HyperParameterError, match=r"\(max_grad_norm=-1\) must be a finite number of at least 0"
    ):
        art_optimizer({"max_grad_norm": -1})
    assert MegatronBackend()._rl_optimizer == (0.1, 0.1)


def test_trainer_args_of_the_internal_config_reach_the_optimizer() -> None:
    """ART sets the optimizer through InternalModelConfig(trainer_args=...); register reads
    model._internal_config['trainer_args'] through art_optimizer."""
    from art_mega.backend import art_optimizer

    model = art.TrainableModel(
        name="m",
        project="p",
        base_model="tiny",
        _internal_config={"trainer_args": {"adam_beta2": 0.95, "weight_decay": 0.0, "max_grad_norm": 1.0}},
    )
    optimizer, decay, clip = art_optimizer(model._internal_config["trainer_args"])
    assert (optimizer.beta1, optimizer.beta2, decay, clip) == (0.9, 0.95, 0.0, 1.0)
    with pytest.raises(
        HyperParameterError, match="trainer_args.optim='adamw', which art-mega does not implement"
    ):
        art.TrainableModel(
            name="m", project="p", base_model="tiny", _internal_config={"trainer_args": {"optim": "adamw"}}
        )


def reference_adapter(folder, model_dir, **config: Any):  # noqa: ANN001, ANN201
    """`folder` as a whole PEFT adapter of `model_dir` with the backend fixture's LoRA (rank 8,
    alpha 16; `config` keys replaced), seeded finite values."""
    from tests.unit.trainer.test_warm_start_checks import adapter_tensors, write_adapter

    return write_adapter(
        folder, model_dir, adapter_tensors(model_dir, rank=8), **{"r": 8, "lora_alpha": 16, **config}
    )


def test_kl_ref_adapter_path_names_the_reference_adapter(backend: MegatronBackend, tmp_path) -> None:  # noqa: ANN001
    step = reference_adapter(tmp_path / "0003", backend._model_dir)
    # a checkpoint folder (ART's kl_ref_adapter_path: the adapter files are in it, as ART keeps them)
    for given in (step, str(step)):
        job = train(backend, TRAINABLE, kl_penalty_coef=0.1, kl_ref_adapter_path=given)
        assert job["loss"]["kl_ref_adapter_path"] == str(step.resolve())
        GRPOLossConfig(**job["loss"])
    assert train(backend, TRAINABLE, kl_beta=0.1, kl_ref_adapter_path=step)["loss"]["kl_ref_adapter_path"]
    with pytest.raises(HyperParameterError, match="is the KL reference, but no KL term reads it"):
        train(backend, TRAINABLE, kl_ref_adapter_path=step)
    with pytest.raises(HyperParameterError, match="holds no adapter_config.json"):
        train(backend, TRAINABLE, kl_penalty_coef=0.1, kl_ref_adapter_path=tmp_path)
    with pytest.raises(HyperParameterError, match="must be the path of a PEFT adapter folder"):
        train(backend, TRAINABLE, kl_penalty_coef=0.1, kl_ref_adapter_path=3)
    with pytest.raises(ValueError, match="kl_ref_adapter_path needs kl_penalty_coef > 0 or kl_beta > 0"):
        GRPOLossConfig(kl_ref_adapter_path=str(step))


def test_a_kl_reference_adapter_the_ranks_could_not_load_is_refused_before_the_step(
    backend: MegatronBackend,
    tmp_path,  # noqa: ANN001
) -> None:
    """kl_ref_adapter_path gets a warm start's checks before any rank reads it: whole files,
    tensors fitting the base model, finite values, and the backend's LoRA; a changed file is
    checked again."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from art_mega.errors import AdapterMismatchError

    def refusal(folder) -> str:  # noqa: ANN001
        with pytest.raises(HyperParameterError) as caught:
            train(backend, TRAINABLE, kl_penalty_coef=0.1, kl_ref_adapter_path=folder)
        message = str(caught.value)
        assert "\n" not in message and caught.value.exit_code == 2
        assert message.startswith(f"backend.train(kl_ref_adapter_path={str(folder.resolve())!r}) ")
        return message

    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "adapter_config.json").write_text("{}")
    assert "cannot be the KL reference" in refusal(config_only) and "safetensors is missing" in refusal(
        config_only
    )
    folder = reference_adapter(tmp_path / "ref", backend._model_dir)
    assert train(backend, TRAINABLE, kl_penalty_coef=0.1, kl_ref_adapter_path=folder)["loss"][
        "kl_ref_adapter_path"
    ]
    weights = folder / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    name = sorted(k for k in tensors if "lora_B" in k)[0]
    tensors[name] = tensors[name].copy()
    tensors[name][0, 0] = np.nan
    # the ranks keep what they loaded from a folder: the same folder rewritten is refused
    save_file(tensors, str(weights), metadata={"format": "pt"})
    assert "changed since an earlier step used it as the KL reference" in refusal(folder)
    poisoned = reference_adapter(tmp_path / "poisoned", backend._model_dir)
    save_file(tensors, str(poisoned / "adapter_model.safetensors"), metadata={"format": "pt"})
    assert "not finite" in refusal(poisoned) or "NaN" in refusal(poisoned)
    wide = reference_adapter(tmp_path / "wide", backend._model_dir, r=4)  # config says 4, tensors 8
    assert "does not match" in refusal(wide)
    other = tmp_path / "rank4"
    from tests.unit.trainer.test_warm_start_checks import adapter_tensors, write_adapter

    write_adapter(other, backend._model_dir, adapter_tensors(backend._model_dir, rank=4), lora_alpha=16)
    with pytest.raises(AdapterMismatchError, match="the KL reference adapter \\(kl_ref_adapter_path\\) at"):
        train(backend, TRAINABLE, kl_penalty_coef=0.1, kl_ref_adapter_path=other)


def test_a_close_while_the_reference_is_read_ends_the_step_with_one_sentence(
    backend: MegatronBackend, tmp_path
) -> None:  # noqa: ANN001
    """close() does not wait for a step: one that runs while train reads the KL reference in a
    thread (or waits for the backend's lock) leaves train a backend without a model."""
    folder = reference_adapter(tmp_path / "ref", backend._model_dir)
    real = backend._check_reference

    def closing(path: str, model_dir: Any) -> None:
        backend._model = backend._model_dir = None  # what close() does meanwhile
        real(path, model_dir)

    backend._check_reference = closing  # type: ignore[method-assign]
    model = backend._model
    with pytest.raises(UserError, match="model 'm' is not registered with this backend"):
        asyncio.run(
            backend.train(
                model,
                TRAINABLE,
                kl_penalty_coef=0.1,
                kl_ref_adapter_path=folder,
                allow_training_without_logprobs=True,
            )
        )


def test_close_lets_the_step_in_flight_end_and_a_waiting_step_is_refused(backend: MegatronBackend) -> None:
    """close() takes the backend's lock: a step that runs keeps its ranks and replicas until it
    ends; one that waited behind the close finds the model unregistered."""
    model = backend._model
    release = asyncio.Event()
    order: list[str] = []
    fake_step = backend._step_with

    async def slow_step(*args: Any, **kwargs: Any) -> Any:
        order.append("step started")
        await release.wait()
        order.append("step ended")
        return await fake_step(*args, **kwargs)

    backend._step_with = slow_step  # type: ignore[method-assign]

    async def scenario() -> list[Any]:
        options = {"allow_training_without_logprobs": True}
        first = asyncio.ensure_future(backend.train(model, TRAINABLE, **options))
        while not order:
            await asyncio.sleep(0.01)
        closing = asyncio.ensure_future(backend.close())
        second = asyncio.ensure_future(backend.train(model, TRAINABLE, **options))
        await asyncio.sleep(0.2)
        assert not closing.done() and backend._model is model  # the step in flight keeps the backend
        release.set()
        results = await asyncio.gather(first, closing, second, return_exceptions=True)
        order.append("closed" if backend._model is None else "still registered")
        return results

    first, closed, second = asyncio.run(scenario())
    assert first["learning_rate"] > 0 and closed is None
    assert isinstance(second, UserError) and "model 'm' is not registered with this backend" in str(second)
    assert order == ["step started", "step ended", "closed"]


def test_kl_penalty_reference_step_names_a_committed_checkpoint(backend: MegatronBackend, tmp_path) -> None:  # noqa: ANN001
    from art_mega.trainer import checkpoint

    backend._run_dir, backend._step = tmp_path, 2
    folder = checkpoint.step_dir(checkpoint.checkpoints_dir(tmp_path), 1)
    reference_adapter(checkpoint.adapter_dir(folder), backend._model_dir)
    job = train(backend, TRAINABLE, kl_penalty_coef=0.1, kl_penalty_reference_step=1)
    assert job["loss"]["kl_ref_adapter_path"] == str(checkpoint.adapter_dir(folder).resolve())
    for bad in (3, 2):  # after the current step; the current one's folder deleted (never written here)
        with pytest.raises(
            HyperParameterError, match=rf"kl_penalty_reference_step={bad}\) names no committed"
        ):
            train(backend, TRAINABLE, kl_penalty_coef=0.1, kl_penalty_reference_step=bad)
    with pytest.raises(HyperParameterError, match=r"kl_penalty_reference_step=-1\) must be a whole number"):
        train(backend, TRAINABLE, kl_penalty_coef=0.1, kl_penalty_reference_step=-1)
    with pytest.raises(HyperParameterError, match="both name the KL reference"):
        train(
            backend, TRAINABLE, kl_penalty_coef=0.1, kl_penalty_reference_step=1, kl_ref_adapter_path=folder
        )


# ------------------------------------------------------------------ ART 0.5.23's new options


def test_kl_penalty_source_sample_takes_the_sampling_logprobs_kl() -> None:
    """ART 0.5.23 (`art/loss.py`): "sample" uses kl_t = old_t - ref_t, "current_learner" new_t - ref_t.
    Both tokens trained; ref = log 0.5 on both; coef 1.0."""
    ref = t([0.0, L(0.5), L(0.5)])
    old = t([0.0, L(0.25), L(0.5)])  # sampling: kl = (log 0.5, 0) -> mean log(0.5)/2
    _, loss = check_grpo_options(**{**BASE, "kl_penalty_coef": 1.0, "kl_penalty_source": "sample"})
    assert loss["kl_penalty_source"] == "sample"
    config = GRPOLossConfig(**{**loss, "kl_ref_adapter_path": None})
    out = grpo_loss(new(0.5, 0.5), old, A, MASK, config=config, ref_logprobs=ref)
    kl = [L(0.5), 0.0]
    mean = sum(kl) / 2
    ratios = [0.5 / 0.25, 1.0]  # new / old; cispo weights inside [0, 5]
    expected = -sum(r * (1.0 + (mean - k)) * L(0.5) for r, k in zip(ratios, kl, strict=True)) / 2
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)
    assert out.kl_policy_ref == pytest.approx(mean, abs=1e-6)
    current = grpo_loss(
        new(0.5, 0.5),
        old,
        A,
        MASK,
        config=GRPOLossConfig(**{**config.model_dump(), "kl_penalty_source": "current_learner"}),
        ref_logprobs=ref,
    )
    assert current.kl_policy_ref == pytest.approx(0.0, abs=1e-9)  # new == ref: no penalty


def test_train_config_carries_arts_0_5_23_fields_at_arts_defaults() -> None:
    config = art.TrainConfig()
    assert (config.kl_penalty_source, config.optimizer_save_interval, config.final_training_step) == (
        "current_learner",
        5,
        None,
    )
    _, loss = check_grpo_options(**{**BASE, "config": art.TrainConfig(kl_penalty_source="sample")})
    assert loss["kl_penalty_source"] == "sample"
    _, loss = check_grpo_options(**{**BASE, "config": config})
    assert "kl_penalty_source" not in loss  # ART's default: GRPOLossConfig's
    with pytest.raises(HyperParameterError, match=r"backend.train\(kl_penalty_source='other'\)"):
        check_grpo_options(**{**BASE, "kl_penalty_source": "other"})


def test_optimizer_snapshot_options_are_accepted_with_one_logged_line(caplog) -> None:
    import logging

    from art_mega.backend import check_optimizer_snapshots

    with caplog.at_level(logging.INFO, logger="art_mega.backend"):
        check_optimizer_snapshots(5, None, None)  # ART's defaults: nothing to say
        assert caplog.text == ""
        check_optimizer_snapshots(1, 40, None)
        check_optimizer_snapshots(1, 40, None)  # once per value
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "backend.train(optimizer_save_interval=1): art-mega commits the optimizer state with every "
        "step's checkpoint, so every step resumes exactly (ART snapshots it less often)",
        "backend.train(final_training_step=40): art-mega commits the optimizer state with every "
        "step's checkpoint, so every step resumes exactly (ART snapshots it less often)",
    ]
    with pytest.raises(HyperParameterError, match=r"backend.train\(optimizer_save_interval=0\)"):
        check_optimizer_snapshots(0, None, None)
    with pytest.raises(HyperParameterError, match=r"backend.train\(final_training_step=2.5\)"):
        check_optimizer_snapshots(5, 2.5, None)


def test_backend_train_takes_arts_0_5_23_keywords_at_their_defaults_and_values(
    backend: MegatronBackend,
) -> None:
    """ART's defaults change nothing; kl_penalty_source reaches the job's loss; the snapshot
    options pass (art-mega commits the optimizer every step); TrainConfig carries them too."""
    plain_job = train(backend, TRAINABLE, kl_penalty_source="current_learner", optimizer_save_interval=5)
    assert "kl_penalty_source" not in plain_job["loss"]
    job = train(
        backend,
        TRAINABLE,
        kl_penalty_coef=0.1,
        kl_penalty_source="sample",
        optimizer_save_interval=1,
        final_training_step=3,
    )
    assert GRPOLossConfig(**job["loss"]).kl_penalty_source == "sample"
    assert job["documents"] == plain_job["documents"]
    via_config = train(
        backend, TRAINABLE, config=art.TrainConfig(kl_penalty_coef=0.1, kl_penalty_source="sample")
    )
    assert via_config["loss"]["kl_penalty_source"] == "sample"
    via_model = asyncio.run(
        _model_train(
            backend, {"kl_penalty_source": "sample", "kl_penalty_coef": 0.1, "kl_penalty_step_lag": None}
        )
    )
    assert via_model["loss"]["kl_penalty_source"] == "sample"


async def _model_train(backend: MegatronBackend, dev_config: dict) -> Any:
    model = backend._model
    model._backend = backend
    return await model.train(TRAINABLE, _config=dev_config, allow_training_without_logprobs=True)
