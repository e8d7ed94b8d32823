"""MoE: ``Σ_k w_k·expert_{i_k}(x) [+ σ(g(x))·shared(x)] [+ b]``, ``w, i = topk(score(router(x)))`` → ``transfuse.ops.MoE``.

A mixture-of-experts block is found by dataflow across three graphs:

* the experts: a child whose forward (or the block's own forward, when it loops over an
  ``nn.ModuleList``) adds ``weight · expert(rows)`` into zeros, once per hit expert
  (``experts``); the ids, weights and tokens it reads are followed back into the block;
* the router: the children that compute those ids and weights are inlined into the block's
  graph and the routing is read off it (``routing``). A router that is not understood
  (phimoe's sparsemixer) is kept and called as is: the experts are still fused (its writes in
  place into tensors it allocated itself, axk2's group mask, are its own business);
* the block's output: the routed sum plus shared experts (a child called on the tokens,
  optionally times ``sigmoid`` of a gate child) and at most one 1-D tensor of the block (a bias),
  reshaped back; a tuple output keeps its other members (the router's weights or logits).

Every child the block calls must have a role, every in-place op must be understood, and a
trace may only have assumed what the experts loop explains; anything else is refused with
a tag. Flags read in the traced forwards (``norm_topk_prob``) specialise the traces
(``Trace.specialisation``): each instance is analysed with its own flag values, and every
number (k, groups, eps, scale, alpha, limit) is read per instance from the attribute that
supplied it. A branch on ``self.training`` is evaluated per instance for training mode; a
block whose training path differs fuses for inference and says so when run in training.

Packed experts are used in place (no copies, any layout); per-expert modules, and the per-expert
slices of parameters handed to one shared module, are stacked into the packed layout
(``StackedExperts``), keeping their state-dict keys.

An emitted file gives a block with packed experts ``forward = moe_block(self, x, plan, top_k=...)``,
the plan a class attribute that also names the attribute values the traces assumed
(``MoEPlan.assumes``); blocks of per-expert modules are emitted unchanged.
"""

from .fuser import MoEEmission, MoEFuser, MoEMatch

__all__ = ["MoEEmission", "MoEFuser", "MoEMatch"]
