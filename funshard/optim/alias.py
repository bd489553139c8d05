"""The usual optimizers as chains: ``sgd``, ``adam``, ``adamw``. Each gives
``torch.optim``'s numbers (foreach) bit for bit. Adam and SGD's momentum count each
parameter's own updates, as torch does (``AdamState.count``, ``SGDState.count``): a parameter
first given a gradient after step 0 starts as torch starts it.

    >>> opt = adamw(3e-4, weight_decay=0.1, mask=lambda fqn: fqn.endswith("weight"))
    >>> state = opt.init(params)                      # AdamWState(exp_avg, exp_avg_sq, count)
    >>> params, state = opt.update(grads, state, params, step=0)
"""

from __future__ import annotations

from .base import Optimizer, ScalarOrSchedule
from .combine import chain
from .transforms import add_decayed_weights, scale_by_adam, scale_by_learning_rate, trace


def sgd(lr: ScalarOrSchedule, momentum: float = 0.0, weight_decay: float = 0.0, *,
        nesterov: bool = False, dampening: float = 0.0, mask=None) -> Optimizer:
    """Stochastic gradient descent, matching ``torch.optim.SGD(foreach=True)``.

    Args:
      lr: learning rate, or a schedule ``step -> lr`` (``step`` = updates already applied).
      momentum: momentum factor (>= 0); a leaf's buffer is set to its first grad.
      weight_decay: L2 penalty added to the gradient (>= 0).
      nesterov: use Nesterov momentum (requires momentum > 0 and dampening == 0).
      dampening: dampening for momentum.
      mask: where weight decay applies (see :func:`~funshard.optim.masked`); None: everywhere.

    Returns:
      ``chain(add_decayed_weights(weight_decay), trace(momentum), scale_by_learning_rate(lr))``,
      state :class:`SGDState` (``momentum_buffer``, ``count``). ``update`` donates params and state.
    """
    return chain(add_decayed_weights(weight_decay, mask),
                 trace(momentum, dampening=dampening, nesterov=nesterov),
                 scale_by_learning_rate(lr))


def adam(lr: ScalarOrSchedule, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
         weight_decay: float = 0.0, *, mask=None) -> Optimizer:
    """Adam with an L2 penalty, matching ``torch.optim.Adam(foreach=True)``; state
    :class:`AdamState`. Args as :func:`adamw`."""
    return chain(add_decayed_weights(weight_decay, mask), scale_by_adam(*betas, eps),
                 scale_by_learning_rate(lr))


def adamw(lr: ScalarOrSchedule, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 0.01, *, mask=None, fused: bool = False) -> Optimizer:
    """AdamW (decoupled weight decay), matching ``torch.optim.AdamW(foreach=True)``.

    Args:
      lr: learning rate, or a schedule ``step -> lr`` (``step`` = updates already applied;
        bias corrections use ``step + 1``).
      betas: coefficients ``(beta1, beta2)`` of the running averages, each in [0, 1).
      eps: term added to the denominator (>= 0).
      weight_decay: decoupled weight decay, applied as ``p *= 1 - lr * weight_decay`` (>= 0).
      mask: where weight decay applies, e.g. ``lambda fqn: not fqn.endswith("bias")``.
      fused: one fused kernel per device and dtype for the whole update, as
        ``torch.optim.AdamW(fused=True)`` (its numbers; no temporaries, one pass over
        memory); default: ``torch.optim.AdamW(foreach=True)``'s numbers, bit for bit.

    Returns:
      ``chain(scale_by_adam(*betas, eps), add_decayed_weights(weight_decay, mask),
      scale_by_learning_rate(lr))``, state :class:`AdamWState` (``exp_avg``, ``exp_avg_sq``,
      ``count``).
      ``update`` donates params and state.

    Example::

      opt = adamw(1e-3, weight_decay=0.1)
      state = opt.init(params)
      for step in range(n):
          params, state = opt.update(grads_fn(params), state, params, step=step)
    """
    return chain(scale_by_adam(*betas, eps, fused=fused), add_decayed_weights(weight_decay, mask),
                 scale_by_learning_rate(lr))
