"""Cutting a built Keras Functional or Sequential model into a chain of blocks at layer names.

A layer ``L`` is a *cut point* when every layer that depends on the model's first input is either an
ancestor of ``L`` or a descendant of it: then "everything up to ``L``" and "everything after ``L``" split
the graph in two, and the border between them is every tensor made before the cut and used after it
(``L``'s output, plus any skip connection or concatenation input that crosses it). A layer running
beside ``L`` on a parallel branch (one side of a residual block) makes ``L`` impossible to cut; the ops
that compute a Keras mask do not (they run early, and the mask crosses the cut as a boolean border tensor).
Cut points form a chain, so the model becomes a chain of segments; consecutive segments are merged
so the network keeps at most ``max_blocks`` blocks.

The blocks run the model's own layers, in the model's own order, so the variables are the model's
and ``model.save()`` after training holds the trained weights.
"""

from __future__ import annotations

import difflib
import math
from typing import Mapping, Sequence

import keras
import tensorflow as tf

from .. import rules
from ..backend import keras_internals as internals
from ..rules import name_list
from .network import Network, unique_variables

README_SECTION = 'the README section "Your own model", README.md#your-own-model'


class KerasNetwork(Network):
    """A ``Network`` cut from a Keras model; boundary names are the model's layer names at cut points.

    Built by ``Network.from_keras``; ``cut_points`` lists every layer the graph could be cut at (in
    order), ``boundaries`` the ones kept as block borders.
    """

    def __init__(self, *args, model_name: str, cut_points: Sequence[str], layer_order: Sequence[str],
                 reasons: Mapping[str, str], **kwargs):
        super().__init__(*args, **kwargs)
        self.model_name = model_name
        self.cut_points = list(cut_points)
        self.names_hint = "net.boundaries lists them all"  # where a shortened list of names can be read whole
        self._layer_order = list(layer_order)
        self._reasons = dict(reasons)

    def build(self, batch) -> None:
        """The model's layers are built already; only the batch is checked."""
        self.check_batch(batch)

    def boundary_starts(self, names: Sequence[str]) -> list[int]:
        unknown = [n for n in names if isinstance(n, str) and n not in self.boundaries]
        if unknown:  # the model's own reason: no such layer, merged into a block, or not a cut
            raise rules.RuleError(self._why_not(unknown[0]), "not_a_cut", unknown=unknown)
        return rules.resolve_boundaries(self.boundaries, names)

    def _why_not(self, name: str) -> str:
        allowed = list(self.boundaries)
        listed = f"Allowed cut layers{name_list(allowed, self.names_hint)}."
        if name not in self._layer_order:
            close = difflib.get_close_matches(name, allowed, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            return (f"Unknown section boundary {name!r}: model {self.model_name!r} has no layer of that "
                    f"name{hint}. {listed}")
        before, after = self._nearest(name)
        near = " and ".join(repr(n) for n in (before, after) if n) or "none"
        if name in self.cut_points:
            return (f"Section boundary {name!r}: a valid cut of model {self.model_name!r}, but merged into a "
                    f"larger block to keep the network at {len(self.blocks)} blocks; nearest allowed: {near} "
                    f"(keep=[{name!r}] keeps it; a larger max_blocks keeps more). {listed}")
        return (f"Section boundary {name!r}: model {self.model_name!r} cannot be cut at that layer "
                f"({self._reasons.get(name, 'it is not on the chain of cut points')}); nearest allowed: "
                f"{near}. {listed}")

    def _nearest(self, name: str) -> tuple[str | None, str | None]:
        pos = self._layer_order.index(name)
        order = {n: i for i, n in enumerate(self._layer_order)}
        kept = sorted(self.boundaries, key=order.__getitem__)
        before = [n for n in kept if order[n] < pos]
        after = [n for n in kept if order[n] > pos]
        return (before[-1] if before else None), (after[0] if after else None)


class Segment:
    """Runs a slice of a Keras model's graph: the block "layer" the engine calls.

    ``segment(h, training=...)`` or ``segment((h, *fields), training=...)``, where ``h`` is the first
    model input (first segment) or the tuple of border tensors, and ``fields`` the extra model inputs
    this segment reads from the batch. Returns the next border tuple, or the model's outputs in the
    model's own structure (last segment).

    A plain object rather than a Keras layer, so no wrapper casts, renames or re-tracks anything: each
    of the model's layers is called exactly as the model calls it.
    """

    def __init__(self, graph: "_Graph", nodes: Sequence[int], in_ids: Sequence[int],
                 field_ids: Sequence[int], out_ids: Sequence[int] | None, first: bool):
        self._graph = graph
        self._nodes = list(nodes)
        self._in_ids = list(in_ids)
        self._field_ids = list(field_ids)
        self._out_ids = None if out_ids is None else list(out_ids)
        self._first = first

    @property
    def layers(self) -> list:
        return unique_variables(self._graph.operation(i) for i in self._nodes)

    @property
    def trainable_variables(self) -> list:
        return unique_variables(v for op in self.layers for v in getattr(op, "trainable_variables", ()))

    @property
    def non_trainable_variables(self) -> list:
        return unique_variables(v for op in self.layers for v in getattr(op, "non_trainable_variables", ()))

    def __call__(self, inputs, training=None):
        g = self._graph
        if self._field_ids:
            h, *extra = inputs
        else:
            h, extra = inputs, []
        if self._first:
            values = {self._in_ids[0]: g.convert_input(self._in_ids[0], h)}
        else:
            values = dict(zip(self._in_ids, h))
        values.update((i, g.convert_input(i, x)) for i, x in zip(self._field_ids, extra))
        for i in self._nodes:
            node = g.nodes[i]
            op = g.operation(i)
            args, kwargs = node.arguments.fill_in(values)
            if training is not None and "training" in internals.call_context_args(op):
                kwargs["training"] = training
            outs = op(*args, **kwargs)
            values.update((id(x), y) for x, y in zip(node.outputs, tf.nest.flatten(outs)))
        if self._out_ids is None:
            return g.pack_outputs([values[id(x)] for x in g.fn.outputs])
        return tuple(values[i] for i in self._out_ids)


class _Graph:
    """The model's nodes in execution order, with ancestor/descendant sets as bit masks."""

    def __init__(self, model):
        self.model = model
        self.fn = _functional(model)
        self.input_ids = [id(x) for x in self.fn.inputs]
        self.nodes = []
        by_depth = internals.nodes_by_depth(self.fn)
        for depth in sorted(by_depth, reverse=True):
            for node in by_depth[depth]:
                if node.operation is not None and not node.is_input:
                    self.nodes.append(node)
        producer = {id(x): i for i, n in enumerate(self.nodes) for x in n.outputs}
        self.tensors = {id(x): x for x in self.fn.inputs}  # tensor id -> the Keras tensor, for its shape
        self.tensors.update((id(x), x) for node in self.nodes for x in node.outputs)
        self.producer = producer
        n = len(self.nodes)
        self.parents = [sorted({producer[id(x)] for x in node.input_tensors if id(x) in producer})
                        for node in self.nodes]
        self.reads = [[id(x) for x in node.input_tensors] for node in self.nodes]
        self.anc = [0] * n
        on_main = [False] * n
        main = self.input_ids[0]
        for i in range(n):
            for p in self.parents[i]:
                self.anc[i] |= self.anc[p] | (1 << p)
                on_main[i] = on_main[i] or on_main[p]
            on_main[i] = on_main[i] or main in self.reads[i]
        self.desc = [0] * n
        for i in range(n - 1, -1, -1):
            for p in self.parents[i]:
                self.desc[p] |= self.desc[i] | (1 << i)
        self.output_ids = [id(x) for x in self.fn.outputs]
        # The chain runs to the model's deepest output; a side branch that only leads to other outputs
        # (an auxiliary head) is a "head": it runs as soon as its inputs exist and never blocks a cut.
        ends = [producer[t] for t in self.output_ids if t in producer]
        last = max(ends, key=lambda i: (bin(self.anc[i]).count("1"), i)) if ends else n - 1
        chain = self.anc[last] | (1 << last)
        self.on_main = [on_main[i] and bool(chain >> i & 1) for i in range(n)]
        # Nodes that only compute a Keras mask (Embedding(mask_zero=True)'s ``not_equal``, Masking's ``any``)
        # read an earlier tensor and feed only ``mask=`` arguments: like heads, they run as soon as their
        # inputs exist and never block a cut; the mask they make crosses a cut as a (boolean) border tensor.
        self.masks = self._mask_nodes()
        self.heads = [i for i in range(n) if on_main[i] and not self.on_main[i] and i not in self.masks]
        self.main_mask = sum(1 << i for i in range(n) if self.on_main[i] and i not in self.masks)
        self.side = sorted(set(self.heads) | self.masks)
        names = [self.operation(i).name for i in range(n)]
        self.names = names
        self.node_count = {nm: names.count(nm) for nm in names}

    def before(self, i: int) -> int:
        """The nodes that run up to a cut after node ``i``: its ancestors, and side nodes (heads, mask ops)
        whose inputs exist."""
        mask = self.anc[i] | (1 << i)
        for j in self.side:  # in execution order, so a chain of side nodes is taken whole
            if not mask >> j & 1 and all(mask >> p & 1 for p in self.parents[j]):
                mask |= 1 << j
        return mask

    def _mask_nodes(self) -> set[int]:
        """Nodes whose outputs are read only as ``mask=`` arguments, directly or through other such nodes."""
        uses = {}  # tensor id -> [(consumer, read as a mask only)]
        for j, node in enumerate(self.nodes):
            kwargs = node.arguments.kwargs
            as_mask = {id(x) for x in keras.tree.flatten(kwargs.get("mask"))}
            other = {id(x) for x in keras.tree.flatten((node.arguments.args,
                                                        {k: v for k, v in kwargs.items() if k != "mask"}))}
            for t in as_mask | other:
                uses.setdefault(t, []).append((j, t not in other))
        masks = set()
        for i in range(len(self.nodes) - 1, -1, -1):
            outs = [id(x) for x in self.nodes[i].outputs]
            if any(t in self.output_ids for t in outs):
                continue
            readers = [u for t in outs for u in uses.get(t, [])]
            if readers and all(only or j in masks for j, only in readers):
                masks.add(i)
        return masks

    def operation(self, i: int):
        return internals.operation_for_node(self.fn, self.nodes[i])

    def convert_input(self, tensor_id: int, x):
        ref = self.fn.inputs[self.input_ids.index(tensor_id)]
        return keras.ops.convert_to_tensor(x, dtype=ref.dtype)

    def pack_outputs(self, flat):
        out = tf.nest.pack_sequence_as(internals.outputs_struct(self.fn), flat)
        if isinstance(out, (list, tuple)) and len(out) == 1:
            return out[0]
        return out

    def cut_points(self) -> tuple[list[int], dict[str, str]]:
        """Nodes the graph can be cut after, in order, and why each other layer cannot be."""
        n = len(self.nodes)
        allowed, reasons = [], {}
        everything = (1 << n) - 1
        for i in range(n):
            name = self.names[i]
            if self.node_count[name] > 1:
                reasons[name] = f"the layer is used {self.node_count[name]} times in the graph"
                continue
            if i in self.heads:
                reasons[name] = "it is on a side branch that only leads to a model output"
                continue
            if i in self.masks:
                reasons[name] = "it computes a Keras mask, which runs beside the layers it masks"
                continue
            if not self.on_main[i]:
                reasons[name] = "it does not depend on the model's first input"
                continue
            before = self.before(i)
            if before == everything:
                reasons[name] = "it is the model's last layer"
                continue
            beside = self.main_mask & ~(before | self.desc[i])
            if beside:
                other = self.names[(beside & -beside).bit_length() - 1]
                reasons[name] = f"it sits inside a branch: layer {other!r} runs beside it"
                continue
            allowed.append(i)
        allowed.sort(key=lambda i: bin(self.anc[i]).count("1"))
        return allowed, reasons

    def tensor_bytes(self, tensor_id: int) -> int | None:
        """Bytes per example of a tensor of the graph (its shape after the batch axis); None where not known."""
        x = self.tensors.get(tensor_id)
        shape = list(getattr(x, "shape", None) or ())[1:]
        if x is None or any(d is None for d in shape):
            return None
        return math.prod(shape) * tf.as_dtype(x.dtype).size

    def output_bytes(self) -> list[int | None]:
        """Per node, the bytes per example its outputs hold (None where a size is not known)."""
        sizes = []
        for node in self.nodes:
            each = [self.tensor_bytes(id(x)) for x in node.outputs]
            sizes.append(None if None in each else sum(each))
        return sizes

    def weight_bytes(self) -> list[int]:
        """Per node, the bytes of its layer's trainable weights (a layer used twice counts at its first node)."""
        seen, sizes = set(), []
        for i in range(len(self.nodes)):
            weights = [v for v in getattr(self.operation(i), "trainable_weights", ()) if id(v) not in seen]
            seen.update(id(v) for v in weights)
            sizes.append(sum(math.prod(v.shape) * tf.as_dtype(v.dtype).size for v in weights))
        return sizes

    def border(self, before_mask: int) -> list[int]:
        """Tensor ids made before the cut and read after it (or returned by the model), in node order."""
        after = [i for i in range(len(self.nodes)) if not before_mask >> i & 1]
        needed = {t for i in after for t in self.reads[i]} | set(self.output_ids)
        return [id(x) for i in range(len(self.nodes)) if before_mask >> i & 1
                for x in self.nodes[i].outputs if id(x) in needed]


def from_keras(model, loss, inputs: str = "image", fields=None, metrics=None, loss_fields=None,
               max_blocks: int = 64, keep: Sequence[str] = (), names_hint: str | None = None) -> KerasNetwork:
    """A ``Network`` of blocks cut from a built Keras Functional or Sequential model.

    Args:
        model: a built ``keras.Model`` made with the functional API, or a built ``keras.Sequential``.
        loss: ``loss(outputs, batch) -> scalar``; ``outputs`` has the model's output structure.
        inputs: the batch key of the model's first input.
        fields: batch keys of the model's other inputs: a list in ``model.inputs[1:]`` order, or a dict
            ``{input name: batch key}``. Default: each input's own name.
        metrics, loss_fields: as for ``Network``.
        max_blocks: at most this many blocks; cut points beyond that are merged (those with the
            smallest borders are kept, spread evenly along the model).
        keep: layer names that must stay block borders (so ``sections`` may name them).
        names_hint: where the user can read a list of names whole, for errors that shorten it
            (default: ``net.boundaries`` / ``KerasNetwork.cut_points``).

    Also ``sections.Network.from_keras``. The blocks call the model's own layers, so after training ``model``
    holds the trained weights.

    Example:
        >>> net = sections.from_keras(keras.applications.ResNet50V2(weights=None, classes=10),
        ...                           loss=lambda out, batch: ..., inputs="image")
        >>> Engine(net, optimizer, sections=["conv3_block1_out", "conv4_block1_out"])
    """
    graph = _Graph(_checked(model))
    field_keys = _field_keys(graph.fn, inputs, fields)
    cuts, reasons = graph.cut_points()
    names = graph.names
    if isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or max_blocks < 1:
        raise ValueError(f"max_blocks={max_blocks!r}: must be an int >= 1.")
    kept = _choose_cuts(graph, cuts, max_blocks - 1, _keep_nodes(graph, cuts, reasons, keep, names_hint))

    segment_of = []
    before_masks = [graph.before(c) for c in kept]
    for i in range(len(graph.nodes)):
        segment_of.append(next((s for s, m in enumerate(before_masks) if m >> i & 1), len(kept)))
    borders = [graph.border(m) for m in before_masks]
    blocks, boundaries = [], {}
    taken = set()
    for s in range(len(kept) + 1):
        nodes = [i for i, seg in enumerate(segment_of) if seg == s]
        read = {t for i in nodes for t in graph.reads[i]}
        extra = [t for t in graph.input_ids if t in read and (s > 0 or t != graph.input_ids[0])]
        in_ids = [graph.input_ids[0]] if s == 0 else borders[s - 1]
        segment = Segment(graph, nodes, in_ids, extra, borders[s] if s < len(kept) else None, first=s == 0)
        name = names[kept[s]] if s < len(kept) else names[nodes[-1]] if nodes else "outputs"
        while name in taken:
            name += "_"
        taken.add(name)
        block_fields = tuple(field_keys[t] for t in extra)
        blocks.append((name, segment, block_fields) if block_fields else (name, segment))
        if s > 0:
            boundaries[names[kept[s - 1]]] = s
    if len(blocks) == 1:
        boundaries = {}
    net = KerasNetwork(
        blocks, loss=loss, inputs=inputs, metrics=metrics, loss_fields=loss_fields,
        boundaries=boundaries or {blocks[0][0]: 0},
        model_name=model.name,
        cut_points=[names[c] for c in cuts], layer_order=names, reasons=reasons,
    )
    if names_hint:
        net.names_hint = names_hint
    net.source_model = model  # the layers' own model, with the trained weights (``sections.to_keras``)
    return net


def _checked(model, user: str = "Network.from_keras"):
    """A built Functional or Sequential model, or one line saying what ``user`` (the caller's name) cannot take."""
    if not isinstance(model, keras.Model):
        raise ValueError(f"{user} needs a keras.Model (Functional or Sequential); got {type(model).__name__}.")
    if isinstance(model, keras.Sequential):
        if internals.functional_graph(model) is None:
            raise ValueError(f"{user}: Sequential model {model.name!r} is not built: give it a "
                             f"keras.Input(shape=...) as its first layer, or call model.build(input_shape) first.")
        return model
    if not internals.is_functional(model):
        raise ValueError(
            f"{user} cannot cut model {model.name!r} of class {type(model).__name__}: it is a subclassed model, "
            f"whose call() is Python code with no layer graph to cut. Build it with the functional API or "
            f"keras.Sequential, or write the blocks by hand as a sections.Network (see {README_SECTION}).")
    if not model.built:
        raise ValueError(f"Model {model.name!r} is not built; call it on a batch first.")
    return model


def _functional(model):
    return internals.functional_graph(model)


def _field_keys(fn, inputs: str, fields) -> dict[int, str]:
    if not isinstance(inputs, str) or not inputs:
        raise ValueError(f"inputs={inputs!r}: must be the batch key of the model's first input.")
    others = fn.inputs[1:]
    input_names = [x.name for x in others]
    if fields is None:
        keys = input_names
    elif isinstance(fields, Mapping):
        unknown = [k for k in fields if k not in input_names]
        if unknown:
            raise ValueError(f"fields names {unknown}, which are not extra inputs of model {fn.name!r}; its "
                             f"inputs after the first are {input_names}.")
        keys = [fields.get(n, n) for n in input_names]
    else:
        keys = [fields] if isinstance(fields, str) else list(fields)
        if len(keys) != len(others):
            raise ValueError(f"fields={keys}: model {fn.name!r} has {len(others)} input(s) after the first "
                             f"({input_names}); give one batch key for each.")
    return {id(fn.inputs[0]): inputs, **{id(x): k for x, k in zip(others, keys)}}


def _keep_nodes(graph: _Graph, cuts: list[int], reasons: dict, keep: Sequence[str], hint: str | None) -> list[int]:
    if isinstance(keep, str):
        keep = [keep]
    by_name = {graph.names[c]: c for c in cuts}
    out = []
    for name in keep:
        if name not in by_name:
            why = reasons.get(name, "no layer has that name")
            raise ValueError(f"keep={list(keep)}: cannot cut model {graph.fn.name!r} at {name!r} ({why}); "
                             f"cut points{name_list(list(by_name), hint or 'KerasNetwork.cut_points lists them all')}.")
        out.append(by_name[name])
    return out


def _choose_cuts(graph: _Graph, cuts: list[int], budget: int, forced: list[int]) -> list[int]:
    """At most ``budget`` cut points (plus ``forced``): the borders of fewest tensors first; where a group of them
    is more than the room left, spread by bytes rather than by layer count (``_spread``)."""
    if len(cuts) <= budget:
        return cuts
    chosen = set(forced)
    room = budget - len(chosen)
    width = {c: len(graph.border(graph.before(c))) for c in cuts}
    for w in sorted(set(width.values())):
        group = [c for c in cuts if width[c] == w and c not in chosen]
        if room <= 0:
            break
        if len(group) <= room:
            chosen.update(group)
            room -= len(group)
        else:
            chosen.update(_spread(graph, group, room))
            room = 0
    return [c for c in cuts if c in chosen]


def _spread(graph: _Graph, group: list[int], room: int) -> list[int]:
    """``room`` of the cuts ``group``, spread by what a section's backward holds for the layers between them: the
    model's layers split into equal shares of the bytes their outputs hold per example plus equal shares of their
    weights' bytes (which their gradients repeat), each share giving its cut with the smallest border. Blocks come
    out finer where activations or weights are large (a network's high-resolution layers), where a section's
    memory is decided; by layer count where sizes are not known per example (a free sequence length)."""
    outputs = graph.output_bytes()
    if None in outputs or not sum(outputs):
        outputs = [1] * len(outputs)
    weight = [o / sum(outputs) for o in outputs]
    params = graph.weight_bytes()
    if sum(params):
        weight = [w + p / sum(params) for w, p in zip(weight, params)]
    position, border = {}, {}
    for c in group:
        mask = graph.before(c)
        position[c] = sum(w for i, w in enumerate(weight) if mask >> i & 1)
        border[c] = sum(graph.tensor_bytes(t) or 0 for t in graph.border(mask))
    total = sum(weight)
    best: list[int] = []
    for shares in range(room, 4 * len(group) + 1):  # more shares give more cuts, not always one more each time
        pick: dict[int, int] = {}
        for c in group:
            k = min(int(position[c] / total * shares), shares - 1)
            if k not in pick or border[c] < border[pick[k]]:
                pick[k] = c
        if len(best) < len(pick) <= room:
            best = list(pick.values())
        if len(best) == room:
            break
    while len(best) < room:  # the rest where the widest gap between chosen cuts is
        marks = sorted([0.0, total, *(position[c] for c in best)])
        middle = max((b - a, (a + b) / 2) for a, b in zip(marks, marks[1:]))[1]
        best.append(min((c for c in group if c not in best), key=lambda c: abs(position[c] - middle)))
    return best
