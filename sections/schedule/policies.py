"""What a section keeps between its forward and its backward: one small object per policy.

A policy has a forward (input border, batch fields -> output border, what it keeps) and a backward (what it
kept, upstream gradient -> gradient on its input, gradients on its variables), in the spirit of
``jax.vjp``: the engine's cycle only moves what each section keeps from one to the other. ``fns`` is the
section's compiled functions (``sections.step.section_functions.SectionFunctions``); ``snapshot`` is the section's state
before its first run in this step (``None`` on that first run), which every re-run replays.

A new policy is one class here: a subclass with ``forward``, ``backward`` and ``cost`` (what the planner needs to
weigh it), its static facts (``keeps_input``, ``reruns_forward``, ``resume_offset``: what the step's program and
its forward-run counter read), and ``@register`` to give it a name configs can use. This module imports no
TensorFlow at load, so ``sections.rules`` derives the allowed names from the registry.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PolicyCost:
    """What a policy costs on one section, for the planner.

    kept_bytes: held from the section's forward until its backward (besides its output border).
    backward_bytes: the section's own working memory during its backward (besides borders and gradients).
    extra_seconds: forward work its backward adds (a re-run).
    """

    kept_bytes: int
    backward_bytes: int
    extra_seconds: float


class Policy:
    """Base class. ``keeps_input``: whether the step's first forward keeps the section's input border.
    ``reruns_forward``: whether its backward runs the section's forward again. ``resume_offset``: which border
    what it keeps holds, for a re-creating descent to start from (0: its input, 1: its output, None: none)."""

    name = "policy"
    keeps_input = True
    reruns_forward = True
    resume_offset: int | None = None

    def forward(self, fns, h, view, snapshot):
        """Returns ``(output border, snapshot, kept)``."""
        raise NotImplementedError

    def backward(self, fns, kept, view, upstream, snapshot, expected=None):
        """Returns ``(gradients on the input's float leaves, gradients on the section's variables)``."""
        raise NotImplementedError

    def cost(self, profile) -> PolicyCost:
        """``profile``: the section's ``sections.backend.profile.SectionProfile`` at the real batch."""
        raise NotImplementedError

    def input_border(self, kept):
        """The section's input border if what it kept includes it (check mode compares re-runs with it)."""
        return None

    def resume_border(self, kept):
        """The border (``index + resume_offset``) a re-creating descent starts from."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.name

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash(type(self))


POLICIES: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Name a policy class, so configs and ``policy="<name>"`` can pick it (``sections.rules.POLICIES``)."""
    POLICIES[cls.name] = cls
    return cls


@register
class Recompute(Policy):
    """Keep the input border; re-run the forward from it in the backward (state replayed)."""

    name = "recompute"
    resume_offset = 0

    def forward(self, fns, h, view, snapshot):
        out, snapshot = fns.forward(h, view, snapshot)
        return out, snapshot, h

    def backward(self, fns, kept, view, upstream, snapshot, expected=None):
        return fns.rerun_backward(kept, view, upstream, snapshot, expected)

    def cost(self, profile) -> PolicyCost:
        return PolicyCost(0, profile.activation_bytes, profile.forward_seconds)

    def input_border(self, kept):
        return kept

    def resume_border(self, kept):
        return kept


@register
class Store(Policy):
    """Keep what the forward's tape needs; the backward re-runs nothing."""

    name = "store"
    reruns_forward = False
    resume_offset = 1

    def forward(self, fns, h, view, snapshot):
        import tensorflow as tf

        tape = tf.GradientTape()
        try:
            with tape:
                fns.watch(tape, h)
                out, snapshot = fns.forward(h, view, snapshot)
        except RuntimeError as err:
            if "Mismatching tf.distribute.Strategy" not in str(err):
                raise
            # A cross-replica op inside (synchronized batch norm's all-reduce) has a gradient that must run in
            # replica context, which a tape kept outside strategy.run cannot give it.
            raise ValueError(f"{fns.section.name}: policy 'store' cannot keep a tape across a cross-replica op "
                             f"(synchronized batch norm) under a strategy; use 'recompute' for it.") from None
        return out, snapshot, (tape, h, out)

    def backward(self, fns, kept, view, upstream, snapshot, expected=None):
        tape, h, out = kept
        return fns.tape_backward(tape, h, out, upstream)

    def cost(self, profile) -> PolicyCost:
        return PolicyCost(profile.stored_bytes, profile.transient_bytes, 0.0)

    def input_border(self, kept):
        return kept[1]

    def resume_border(self, kept):
        return kept[2]


@register
class Recreate(Recompute):
    """Multi-level recompute: the first forward drops the input border; the backward re-creates it by
    re-running the chain from the nearest kept border (as the schedule says), then re-runs like ``recompute``."""

    name = "recreate"
    keeps_input = False


#: What a descent's ``"keep"`` action runs: keep the input border, for a re-run in the backward.
KEEP_INPUT = Recompute()


def resolve(policy) -> Policy:
    """A policy object from a name or an object."""
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str) and policy in POLICIES:
        return POLICIES[policy]()
    raise ValueError(f"Unknown policy {policy!r}; allowed: {list(POLICIES)} or a sections.Policy object.")
