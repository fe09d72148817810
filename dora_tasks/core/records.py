"""Typed records that travel between Dask tasks.

Every record carries versions: a trajectory knows the policy version of each of its response tokens (C1 is checkable
only then), a group knows the version it was dispatched on and the instance that generated it, and a consumed group
knows the update that trained on it. No free-form dict payloads cross task boundaries.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Prompt:
    """One prompt of the dataset, with the ground truth its reward function needs."""

    prompt_id: int
    text: str
    answer: str
    token_ids: tuple[int, ...] = ()
    row_json: str = ""  # the dataset row's fields as JSON text, for rewards that read them ("" = none)

    @property
    def row(self) -> dict:
        """The dataset row as a fresh dict: JSON text keeps the record small, hashable and the same after pickling."""
        return json.loads(self.row_json) if self.row_json else {}


@dataclass
class Generation:
    """What a rollout engine returns for one sampled response."""

    token_ids: np.ndarray  # int32 [T]
    logprobs: np.ndarray  # float32 [T], log-prob of each sampled token under the generating policy
    versions: np.ndarray  # int32 [T], policy version that produced each token
    finished: bool  # True when the response ended with EOS, False when cut at max_new_tokens


def _pack(array) -> tuple[str, tuple[int, ...], bytes]:
    a = np.asarray(array)
    return a.dtype.str, a.shape, a.tobytes()


def _unpack(dtype: str, shape: tuple[int, ...], data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=dtype).reshape(shape).copy()


def _trajectory(group_id, sample_idx, arrays, finished, reward, reward_error, advantage, *episode) -> Trajectory:
    prompt_ids, response_ids, versions, behaviour_logprobs, loss_mask = (_unpack(*a) for a in arrays)
    return Trajectory(group_id, sample_idx, prompt_ids, response_ids, versions, behaviour_logprobs, finished, reward,
                      reward_error, advantage, loss_mask, *episode)


ENVIRONMENT_VERSION = -1  # the `versions` entry of an environment token of a multi-turn episode (no policy made it)


@dataclass
class Trajectory:
    """One response to one prompt, with everything the trainer and the audit need.

    Pickled with its four arrays as plain bytes: Dask pickles with protocol 5 and would send every numpy array out of
    band as a frame of its own, and for arrays this small the frames' overhead is what costs (docs/benchmark.md).
    """

    group_id: int
    sample_idx: int
    prompt_ids: np.ndarray  # int32 [P]
    response_ids: np.ndarray  # int32 [T]
    versions: np.ndarray  # int32 [T]
    behaviour_logprobs: np.ndarray  # float32 [T]
    finished: bool
    reward: float = float("nan")
    reward_error: str = ""  # exception text or "timeout"; empty when the reward function returned a number
    advantage: float = float("nan")
    # multi-turn episodes (`dora_tasks.episodes`): which response tokens the model produced (1) and which the
    # environment did (0: version ENVIRONMENT_VERSION, behaviour log-prob 0, left out of the loss); None = all model
    loss_mask: np.ndarray | None = None  # int8 [T]
    turns: int = 1  # model turns of the episode (1 for a single-turn response)
    tool_calls: int = 0  # environment steps that ran a tool
    env_error: str = ""  # the environment's exception text or "timeout"; the episode ended there
    env_reward: float = float("nan")  # the environment's reward (sum of its steps'); NaN: it gave none

    def __post_init__(self) -> None:
        if self.loss_mask is None:
            self.loss_mask = np.ones(len(self.response_ids), dtype=np.int8)

    def __reduce__(self):
        arrays = tuple(_pack(a) for a in (self.prompt_ids, self.response_ids, self.versions, self.behaviour_logprobs,
                                          self.loss_mask))
        return _trajectory, (self.group_id, self.sample_idx, arrays, self.finished, self.reward, self.reward_error,
                             self.advantage, self.turns, self.tool_calls, self.env_error, self.env_reward)

    @property
    def num_tokens(self) -> int:
        return int(len(self.prompt_ids) + len(self.response_ids))

    @property
    def distinct_versions(self) -> set[int]:
        """The policy versions of the model's tokens (environment tokens carry none)."""
        return set(int(v) for v in np.unique(self.versions[self.loss_mask.astype(bool)]))


@dataclass
class Group:
    """The G trajectories of one prompt. Dispatched on one version, generated on one instance, completed as a whole."""

    group_id: int
    prompt: Prompt
    version: int  # policy version the group was dispatched (and started) on
    instance: str = ""  # worker address of the rollout instance that generated it
    attempt: int = 0  # >0 when the group was re-dispatched after its instance died
    trajectories: list[Trajectory] = field(default_factory=list)
    start_time: float = 0.0
    end_time: float = 0.0
    filtered: str = ""  # name of the algorithmic filter that excluded it from the loss, if any
    weights: WeightsReceived | None = None  # the instance received its version's weights with this group
    migrations: list[Migration] = field(default_factory=list)  # its responses' moves to other instances, if any
    reward_model: RewardModelScoring | None = None  # how the reward model scored it (`reward.model` set)

    @property
    def rewards(self) -> np.ndarray:
        return np.array([t.reward for t in self.trajectories], dtype=np.float32)

    @property
    def num_tokens(self) -> int:
        return sum(t.num_tokens for t in self.trajectories)


@dataclass
class RewardModelScoring:
    """How a reward model scored one group's responses, on which worker (`reward.model`; see config_reward.py)."""

    worker: str  # address of the worker that ran the model
    role: str  # "REWARD" when that worker carries the REWARD label (where reward models must run)
    scores: tuple[float, ...]  # the model's score of each trajectory, by sample index, before combining
    seconds: float  # this group's share of the forward passes' time (by its responses' share of each batch)
    batch_sizes: tuple[int, ...]  # responses in each forward pass the group's responses took part in
    tasks_per_batch: int  # most scoring tasks merged into one of those forward passes


@dataclass
class Migration:
    """One response of a group handed over by one rollout instance and taken in by another of the same version
    (DORA's request migration), as the receiving instance measured it. Times are on the run's clock."""

    group_id: int
    attempt: int  # the group's dispatch attempt
    sample_idx: int
    version: int  # the version of the session that handed it over (its continuation's)
    target_version: int  # the version of the tokens the receiving instance produced (-1: none, or several)
    source: str  # worker address of the instance that handed it over
    target: str  # worker address of the instance that continued it
    nbytes: int  # the continuation: token arrays, KV cache and sampler state
    reprefill_tokens: int  # tokens the receiver encoded again (0 when the KV cache travelled)
    seconds: float  # taking it in: inserting its cache or re-encoding it (nan: re-encoded within a later chunk)
    handed_over_time: float  # when it left the source's batch
    adopted_time: float  # when it joined the receiver's session


@dataclass
class TrainBatch:
    """The groups one update trains on, after the version gate checked them."""

    update: int  # the update starts from policy version `update` and publishes `update + 1`
    groups: list[Group]
    max_staleness: int

    @property
    def staleness(self) -> list[int]:
        return [self.update - g.version for g in self.groups]


@dataclass
class UpdateResult:
    """What the trainer reports after one update (all floats, so it logs straight to MLflow)."""

    update: int
    metrics: dict[str, float]
    start_time: float
    end_time: float  # the train step's end; the publish of version `update + 1` follows
    published: PublishedWeights | None = None
    busy_s: float | None = None  # a streamed update: seconds it computed between start and end (None: all of them)
    parts: tuple[tuple[float, float, int], ...] = ()  # a streamed update: (start, end, groups) of each part


@dataclass
class UpdatePart:
    """A streamed update so far (`dora.stream_updates`): the parts of its batch the trainer has computed."""

    update: int
    filtered: int = 0  # groups that an algorithmic filter left out of the loss
    spans: tuple[tuple[float, float, int], ...] = ()  # (start, end, groups) of each part, in order

    @property
    def start_time(self) -> float:
        """When the first part began."""
        return self.spans[0][0]

    @property
    def busy_s(self) -> float:
        """Seconds spent computing its parts."""
        return sum(end - start for start, end, _ in self.spans)

    @property
    def groups(self) -> int:
        return sum(groups for *_, groups in self.spans)


@dataclass
class WeightsReceived:
    """How a rollout instance got a version's weights from a peer worker (peer-to-peer transfer through Dask)."""

    version: int
    source: str  # the worker it was copied from ("" when it already held it)
    nbytes: int
    seconds: float  # the transfer, as the receiving worker measured it


@dataclass
class PublishedWeights:
    """A policy version written to the weight store."""

    version: int
    path: str
    seconds: float


@dataclass
class TrainerRestore:
    """A trainer worker restarted after it died, as `restore_trainer` left it."""

    worker: str
    version: int  # the published version its weights come from
    optimizer_from: str = ""  # the checkpoint folder its optimizer state comes from; "" = a fresh optimizer
