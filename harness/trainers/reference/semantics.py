"""The reference trainer's DDP arithmetic in one place, and the bugs real trainers have had.

``Semantics`` holds the correct formulas: which rank's rows a rank trains on, the seed its model
starts from, the learning rate, the factor each rank scales its token-loss sum by (N / T, with
T the step's global supervised token count), how micro-step gradients accumulate, how gradients
are reduced across ranks (``nn.average_gradients``: sum / N) and how the logged loss is formed
(all_sum(loss sum) / T). The trainer calls nothing else for these.

A *mutation* (``[[runs]] mutation = "..."``) is a subclass that overrides one of those methods
with a DDP bug real trainers have had. The harness's checks must catch every one of them: the
mutation scenario proves they do, with each check's value, limit and margin.

``EmulatedRanks`` is one process computing N ranks' shards (its noise-floor twin): each emulated
rank's micro-batches are accumulated on their own, then summed in rank order and divided by N,
the same mathematics as N ranks in their summation order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.scenario.names import MUTATIONS_DESCRIBED


def _tree_map(fn: Any, *trees: Any) -> Any:
    from mlx.utils import tree_map

    return tree_map(fn, *trees)


@dataclass
class Semantics:
    """Correct DDP over ``world_size`` ranks."""

    world_size: int
    grad_accum: int
    rank: int
    group: Any = None

    name = "correct"
    summary = "the reference trainer's semantics"
    fusable = True  # reduce and accumulated are pure functions of their inputs: they may be compiled

    def data_rank(self) -> int:
        """The rank whose rows this rank reads."""
        return self.rank

    def init_seed(self, seed: int) -> int:
        """The seed this rank's model weights are drawn from."""
        return seed

    def learning_rate(self, lr: float) -> float:
        return lr

    def micro_batches(self, micros: list[Any], uneven: bool) -> list[Any]:
        """The micro-batches this rank computes (``uneven``: the last one is shorter on this rank)."""
        return micros

    def scale(self, tokens: int, tokens_local: int) -> float:
        """The factor a rank's token-loss sum is multiplied by before its gradient is taken."""
        return self.world_size / tokens

    def accumulated(self, grads: Any) -> Any:
        """A rank's gradient after its micro-steps were summed."""
        return grads

    def reduce(self, grads: Any) -> Any:
        """The update's gradient from this rank's accumulated gradient: the mean over ranks."""
        import mlx.nn as nn

        return nn.average_gradients(grads, group=self.group)

    def reduce_shards(self, per_shard: list[Any]) -> Any:
        """The update's gradient from the accumulated gradient of each rank this process computes."""
        return self.reduce(per_shard[0])

    def loss(self, loss_sum: Any, tokens: int, tokens_local: int) -> Any:
        """The logged global loss: every rank's token-loss sum over the global token count."""
        import mlx.core as mx

        return mx.distributed.all_sum(loss_sum, group=self.group) / tokens

    def state(self) -> Any:
        """What a probe must put back so that it leaves the trajectory as it was."""
        return None

    def set_state(self, state: Any) -> None:
        pass


class MeanOfMeans(Semantics):
    name = "mean_of_means"
    summary = MUTATIONS_DESCRIBED["mean_of_means"]

    def scale(self, tokens: int, tokens_local: int) -> float:
        return 1.0 / max(tokens_local, 1)

    def loss(self, loss_sum: Any, tokens: int, tokens_local: int) -> Any:
        import mlx.core as mx

        return mx.distributed.all_sum(loss_sum / max(tokens_local, 1), group=self.group) / self.world_size


class SumNotAverage(Semantics):
    name = "sum_not_average"
    summary = MUTATIONS_DESCRIBED["sum_not_average"]

    def reduce(self, grads: Any) -> Any:
        import mlx.core as mx

        return _tree_map(lambda g: mx.distributed.all_sum(g, group=self.group), grads)


class UnreducedNorms(Semantics):
    name = "unreduced_norms"
    summary = MUTATIONS_DESCRIBED["unreduced_norms"]

    def reduce(self, grads: Any) -> Any:
        import mlx.nn as nn
        from mlx.utils import tree_flatten, tree_unflatten

        flat = tree_flatten(grads)
        reduced = dict(tree_flatten(nn.average_gradients(
            tree_unflatten([(k, g) for k, g in flat if "norm" not in k]), group=self.group)))
        return tree_unflatten([(k, reduced.get(k, g)) for k, g in flat])


class SameShard(Semantics):
    name = "same_shard"
    summary = MUTATIONS_DESCRIBED["same_shard"]

    def data_rank(self) -> int:
        return 0


class DropUneven(Semantics):
    name = "drop_uneven"
    summary = MUTATIONS_DESCRIBED["drop_uneven"]

    def micro_batches(self, micros: list[Any], uneven: bool) -> list[Any]:
        return micros[:-1] if uneven and self.rank == self.world_size - 1 else micros


class RankSeeds(Semantics):
    name = "rank_seeds"
    summary = MUTATIONS_DESCRIBED["rank_seeds"]

    def init_seed(self, seed: int) -> int:
        return seed + self.rank


class LrTimesWorld(Semantics):
    name = "lr_times_world"
    summary = MUTATIONS_DESCRIBED["lr_times_world"]

    def learning_rate(self, lr: float) -> float:
        return lr * self.world_size


class AccumTwice(Semantics):
    name = "accum_twice"
    summary = MUTATIONS_DESCRIBED["accum_twice"]

    def accumulated(self, grads: Any) -> Any:
        return _tree_map(lambda g: g / self.grad_accum, grads)


class StaleGradient(Semantics):
    name = "stale_gradient"
    summary = MUTATIONS_DESCRIBED["stale_gradient"]

    _previous: Any = None
    fusable = False  # keeps the previous step's gradient outside the compiled step

    def reduce(self, grads: Any) -> Any:
        previous = self._previous if self._previous is not None else _tree_map(lambda g: g * 0, grads)
        self._previous = grads
        return super().reduce(previous)

    def state(self) -> Any:
        return self._previous

    def set_state(self, state: Any) -> None:
        self._previous = state


class EmulatedRanks(Semantics):
    """One process computing ``world_size`` ranks' shards (``shards`` of them), rank after rank."""

    name = "emulated"
    summary = "one process emulating the ranks' shards"
    fusable = False  # each emulated rank's shard is accumulated on its own

    def reduce_shards(self, per_shard: list[Any]) -> Any:
        total = per_shard[0]
        for g in per_shard[1:]:
            total = _tree_map(lambda a, b: a + b, total, g)
        return _tree_map(lambda g: g / self.world_size, total)

    def loss(self, loss_sum: Any, tokens: int, tokens_local: int) -> Any:
        return loss_sum / tokens


MUTATIONS: dict[str, type[Semantics]] = {cls.name: cls for cls in (
    MeanOfMeans, SumNotAverage, UnreducedNorms, SameShard, DropUneven, RankSeeds, LrTimesWorld, AccumTwice,
    StaleGradient)}


def semantics(mutation: str | None, world_size: int, grad_accum: int, rank: int, group: Any = None,
              emulate: int = 1) -> Semantics:
    """The run's arithmetic: correct, with the named mutation, or one process emulating
    ``emulate`` ranks (whose world size it then takes)."""
    if emulate > 1:
        return EmulatedRanks(emulate, grad_accum, 0, group)
    cls = MUTATIONS[mutation] if mutation else Semantics
    return cls(world_size, grad_accum, rank, group)
