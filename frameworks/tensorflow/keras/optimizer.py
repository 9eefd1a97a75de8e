"""`DistributedOptimizer` for Keras 3 optimizers, `PartialDistributedOptimizer` and `load_model`.

The wrapper is an instance of a subclass of the optimizer's own class (same name, so
`isinstance(opt, keras.optimizers.SGD)` holds), built from the optimizer's config. Gradients are
reduced once per update step, right before Keras clips them (Keras 3 calls `_clip_gradients`
exactly once per update step), so clipping and weight decay see the averaged gradients, as in
Horovod. `backward_passes_per_step=N` uses Keras' own gradient accumulation
(`gradient_accumulation_steps=N`): gradients are summed locally for N steps and reduced on the
N-th (divided by N when `average_aggregated_gradients`).

The class saves under the wrapped optimizer's own name, so `keras.models.load_model` gives back
the plain optimizer and `hvd.load_model` wraps it again.

A `keras.optimizers.LossScaleOptimizer` (mixed precision; `compile` adds one around the
optimizer under the `mixed_float16` policy) never runs its own update path, only its inner
optimizer's: `DistributedOptimizer(LossScaleOptimizer(opt))` therefore returns
`LossScaleOptimizer(DistributedOptimizer(opt))`. A loss-scale optimizer around a
`DistributedOptimizer` skips a step when the gradients are not finite; its finiteness check is
agreed across the process set (all ranks skip, or none), else the ranks that skip would not
join the gradient reduction of the others (a hang, or steps reduced out of order).

A `momentum` option of SGD or RMSprop becomes live: it reads a TF variable inside the compiled
step, so that the learning-rate callbacks' momentum correction takes effect in `model.fit`.
"""
from __future__ import annotations

from typing import Any, Sequence

import keras
import tensorflow as tf

from collective import ProcessSet, ReduceOp, global_process_set

from .._reduce import GradientReducer
from ..compression import Compression

__all__ = ["DistributedOptimizer", "PartialDistributedOptimizer", "load_model", "LiveMomentum"]


class LiveMomentum:
    """A momentum value that compiled steps read from a variable (`assign` changes it live).

    Comparisons (`momentum != 0`, which Keras makes while building) use the configured value.
    """

    def __init__(self, value: float) -> None:
        self.base = float(value)
        self.var = tf.Variable(self.base, trainable=False, dtype=tf.float64,
                               name="hvd_momentum")

    def assign(self, value: float) -> None:
        self.var.assign(float(value))

    def get(self) -> float:
        return float(self.var.numpy())

    def __float__(self) -> float:
        return self.base

    def __eq__(self, other: Any) -> bool:
        return self.base == other

    def __ne__(self, other: Any) -> bool:
        return self.base != other

    def __lt__(self, other: Any) -> bool:
        return self.base < other

    def __gt__(self, other: Any) -> bool:
        return self.base > other

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"LiveMomentum({self.get()})"


tf.register_tensor_conversion_function(
    LiveMomentum, lambda v, dtype=None, name=None, as_ref=False:
    tf.cast(v.var.read_value(), dtype or tf.float64))


class _StepVariables:
    """The variables of the update being applied (a plain holder: a list attribute of the
    optimizer itself would be tracked as the optimizer's own variables)."""

    def __init__(self) -> None:
        self.variables: list = []
        self.layout: int | None = None  # `GradientReducer.align`'s result for this update


class _DistributedOptimizerMixin:
    """Overrides of the wrapped optimizer's class (see the module docstring)."""

    _hvd_reducer: GradientReducer
    _hvd_step: "_StepVariables"
    _hvd_sum_steps: int = 1
    _hvd_user_accumulation: Any = None

    # Keras 2's `lr` alias of `learning_rate`, which Keras 3 dropped: Horovod's examples read
    # and set it (`tf.keras.backend.set_value(state.model.optimizer.lr, lr * hvd.size())` in
    # an elastic reset callback, which otherwise fails only once a worker has died). A
    # variable learning rate comes back as the `tf.Variable` Keras keeps it in, which
    # `tf.keras.backend.get_value`/`set_value` accept (they reject a Keras 3 variable).
    @property
    def lr(self) -> Any:
        lr = self.learning_rate
        return lr.value if isinstance(lr, keras.Variable) else lr

    @lr.setter
    def lr(self, value: Any) -> None:
        self.learning_rate = value

    def register_local_var(self, var: Any) -> None:
        """Keeps `var`'s gradient local (not reduced; scaled by 1/size when
        `scale_local_gradients`): Horovod's name on the Keras optimizer."""
        self._hvd_reducer.register_local_source(var)

    register_local_source = register_local_var  # the gradient tape's name, accepted too

    def apply(self, grads: Sequence[Any], trainable_variables: Any = None) -> Any:
        # Before Keras drops the None gradients: eagerly, a gradient that another rank has is
        # zeros here (None stays None where every rank has None); in a compiled step the
        # kinds were fixed at tracing and their digest goes with the reduction
        # (`GradientReducer.align`).
        grads = list(grads)
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
            variables = trainable_variables
        else:
            variables = list(self._trainable_variables) if self.built else []
        step = self._hvd_step
        if len(variables) == len(grads):
            grads, layout = self._hvd_reducer.align(grads, variables)
            step.layout = layout
        try:
            return super().apply(grads, trainable_variables)
        finally:
            step.layout = None

    def _backend_apply_gradients(self, grads: Any, trainable_variables: Any) -> Any:
        self._hvd_step.variables = list(trainable_variables)
        try:
            return super()._backend_apply_gradients(grads, trainable_variables)
        finally:
            self._hvd_step.variables = []

    def _clip_gradients(self, grads: Any) -> Any:
        grads = list(grads)
        if self._hvd_sum_steps > 1:  # Keras averaged the accumulated gradients; Horovod sums
            grads = [g * tf.cast(self._hvd_sum_steps, g.dtype) for g in grads]
        grads = self._hvd_reducer.reduce(grads, self._hvd_step.variables,
                                         self._hvd_step.layout)
        return super()._clip_gradients(grads)

    def get_config(self) -> dict:
        config = super().get_config()
        if "gradient_accumulation_steps" in config:
            config["gradient_accumulation_steps"] = self._hvd_user_accumulation
        m = config.get("momentum")
        if isinstance(m, LiveMomentum):
            config["momentum"] = m.base
        return config


_keras_check_finite = getattr(keras.optimizers.LossScaleOptimizer.check_finite, "_hvd_original",
                              keras.optimizers.LossScaleOptimizer.check_finite)


def _check_finite_everywhere(self: Any, grads: Any) -> Any:
    """`LossScaleOptimizer.check_finite`, AND-ed across the process set when the inner
    optimizer is a `DistributedOptimizer` (see the module docstring)."""
    finite = _keras_check_finite(self, grads)
    inner = getattr(self, "inner_optimizer", None)
    if not isinstance(inner, _DistributedOptimizerMixin):
        return finite
    return inner._hvd_reducer.all_true(finite)


# Installed on Keras' class (once): `compile` builds a plain LossScaleOptimizer around ours.
_check_finite_everywhere._hvd_original = _keras_check_finite  # type: ignore[attr-defined]
keras.optimizers.LossScaleOptimizer.check_finite = _check_finite_everywhere


def _ours(opt: Any) -> bool:
    """A `DistributedOptimizer`, or a loss-scale optimizer around one."""
    return isinstance(opt, _DistributedOptimizerMixin) or isinstance(
        getattr(opt, "inner_optimizer", None), _DistributedOptimizerMixin)


def _install_auto_jit_rule() -> None:
    """`compile(jit_compile="auto")` (Keras' default) means XLA on a machine with a GPU, where
    ringvod's collectives cannot run (they are `py_function`s): with a `DistributedOptimizer`,
    "auto" resolves to no XLA instead of a `fit` that refuses. `jit_compile=True` still does."""
    from keras.src.trainers import trainer as _trainer  # noqa: PLC0415 - Keras' internals

    cls = getattr(_trainer, "Trainer", None)
    keras_rule = getattr(cls, "_resolve_auto_jit_compile", None)
    if keras_rule is None or getattr(keras_rule, "_hvd_original", None) is not None:
        return

    def resolve(self: Any) -> bool:
        if _ours(getattr(self, "optimizer", None)):
            return False
        return keras_rule(self)
    resolve._hvd_original = keras_rule  # type: ignore[attr-defined]
    cls._resolve_auto_jit_compile = resolve


try:
    _install_auto_jit_rule()
except ImportError:  # another Keras layout: "auto" keeps Keras' own rule
    pass

_classes: dict[type, type] = {}


def _wrapped_class(base: type) -> type:
    cls = _classes.get(base)
    if cls is None:
        exported = getattr(keras.optimizers, base.__name__, None) is base
        cls = type(base.__name__, (_DistributedOptimizerMixin, base),
                   {"__module__": "keras.optimizers" if exported else base.__module__,
                    "__qualname__": base.__qualname__,
                    "__doc__": base.__doc__})
        _classes[base] = cls
    return cls


def DistributedOptimizer(optimizer: Any, name: str | None = None, device_dense: str = "",
                         device_sparse: str = "", compression: Any = Compression.none,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                         op: ReduceOp = ReduceOp.AVERAGE, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Any = None, process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """Wraps a `keras.optimizers.Optimizer` so that gradients are averaged (by `op`) across
    the process set before they are applied. Returns a new optimizer of a subclass of the
    optimizer's class, built from its config (its variables are created on first use).

    Raises:
        ValueError: not a Keras optimizer, already wrapped, `backward_passes_per_step` < 1 or
            combined with the optimizer's own `gradient_accumulation_steps`, an `op` other
            than Average or Sum (Horovod's text; Adasum included), or bad groups.
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError("DistributedOptimizer wraps a keras.optimizers.Optimizer (Keras 3), "
                         f"got {type(optimizer).__name__}")
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        inner = DistributedOptimizer(optimizer.inner_optimizer, name, device_dense,
                                     device_sparse, compression, sparse_as_dense,
                                     gradient_predivide_factor, op, backward_passes_per_step,
                                     average_aggregated_gradients, num_groups, groups,
                                     process_set, scale_local_gradients)
        return keras.optimizers.LossScaleOptimizer(
            inner, initial_scale=optimizer.initial_scale,
            dynamic_growth_steps=optimizer.dynamic_growth_steps, name=optimizer.name)
    if isinstance(optimizer, _DistributedOptimizerMixin):
        raise ValueError("this optimizer is already a DistributedOptimizer")
    if backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be > 0")
    if ReduceOp(int(op)) not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise ValueError("op currently only supports Average and Sum")
    reducer = GradientReducer("DistributedOptimizer", compression, sparse_as_dense, op,
                              gradient_predivide_factor, num_groups, groups, process_set,
                              scale_local_gradients, device_dense, device_sparse)
    config = optimizer.get_config()
    user_accumulation = config.get("gradient_accumulation_steps")
    if backward_passes_per_step > 1:
        if user_accumulation:
            raise ValueError("pass either backward_passes_per_step to DistributedOptimizer or "
                             "gradient_accumulation_steps to the optimizer, not both")
        config["gradient_accumulation_steps"] = backward_passes_per_step
    if name:
        config["name"] = name
    cls = _wrapped_class(type(optimizer))
    new = cls.from_config(config)
    new._hvd_reducer = reducer
    new._hvd_step = _StepVariables()
    new._hvd_user_accumulation = user_accumulation
    new._hvd_sum_steps = (backward_passes_per_step if backward_passes_per_step > 1
                          and not average_aggregated_gradients else 1)
    m = getattr(new, "momentum", None)
    # Only where Horovod's momentum correction applies (SGD, RMSprop): other optimizers do
    # arithmetic on `momentum` (Muon: `self.momentum - 1`), which LiveMomentum does not.
    if (isinstance(m, (int, float)) and not isinstance(m, bool)
            and isinstance(new, (keras.optimizers.SGD, keras.optimizers.RMSprop))):
        new.momentum = LiveMomentum(m)
    return new


def PartialDistributedOptimizer(optimizer: Any, name: str | None = None, device_dense: str = "",
                                device_sparse: str = "", compression: Any = Compression.none,
                                sparse_as_dense: bool = False,
                                gradient_predivide_factor: float = 1.0,
                                op: ReduceOp = ReduceOp.AVERAGE,
                                backward_passes_per_step: int = 1,
                                average_aggregated_gradients: bool = False,
                                num_groups: int = 0, groups: Any = None,
                                process_set: ProcessSet = global_process_set,
                                local_layers: Any = None,
                                scale_local_gradients: bool = True) -> Any:
    """A `DistributedOptimizer` whose `local_layers`' variables keep local gradients."""
    opt = DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression,
                               sparse_as_dense, gradient_predivide_factor, op,
                               backward_passes_per_step, average_aggregated_gradients,
                               num_groups, groups, process_set, scale_local_gradients)
    layers = [] if local_layers is None else (
        list(local_layers) if isinstance(local_layers, (list, tuple)) else [local_layers])
    for layer in layers:
        if not hasattr(layer, "trainable_weights"):
            raise ValueError(f"local_layers must be Keras layers, got {type(layer).__name__}")
        for var in layer.trainable_weights:
            opt.register_local_var(var)
    return opt


def _rewrapper(base: type, kwargs: dict) -> type:
    """A stand-in class for `custom_objects`: its `from_config` builds `base` and wraps it."""
    def from_config(cls: type, config: dict, custom_objects: Any = None) -> Any:
        return DistributedOptimizer(base.from_config(config), **kwargs)
    return type(base.__name__, (), {"from_config": classmethod(from_config)})


def load_model(filepath: Any, custom_optimizers: Sequence[type] | None = None,
               custom_objects: dict | None = None, compression: Any = Compression.none,
               legacy_opts: bool = False, **kwargs: Any) -> Any:
    """`keras.models.load_model` whose optimizer comes back wrapped in `DistributedOptimizer`.

    Args:
        custom_optimizers: optimizer classes beyond `keras.optimizers`' own to re-wrap.
        custom_objects: as for `keras.models.load_model`.
        compression: the re-wrapped optimizer's compression.
        legacy_opts: accepted for Horovod compatibility (Keras 3 has no legacy optimizers).

    Raises:
        ValueError: `filepath` is a legacy HDF5 file (`.h5`, `.hdf5`) saved with an optimizer
            (see `_refuse_h5_optimizer`), or whatever `keras.models.load_model` raises.
    """
    if kwargs.get("compile", True):
        _refuse_h5_optimizer(filepath)
    bases = [c for c in vars(keras.optimizers).values()
             if isinstance(c, type) and issubclass(c, keras.optimizers.Optimizer)
             and c is not keras.optimizers.Optimizer]
    bases += list(custom_optimizers or [])
    objects = {b.__name__: _rewrapper(b, {"compression": compression}) for b in bases}
    objects.update(custom_objects or {})
    return keras.models.load_model(filepath, custom_objects=objects, **kwargs)


def _refuse_h5_optimizer(filepath: Any) -> None:
    """Keras 3 cannot give back a trainable optimizer from a legacy HDF5 file: it builds the
    optimizer on none of the model's variables (its slots are dropped, and the first `fit`
    fails with "Unknown variable"), and it looks the class up by its lower-cased name, so the
    optimizer would come back unwrapped: training without the gradient reduction. A file
    without an optimizer (no training config) loads as it is."""
    if not str(filepath).endswith((".h5", ".hdf5")):  # Keras' own test for the format
        return
    import h5py  # a Keras dependency
    try:
        with h5py.File(filepath, "r") as f:
            has_optimizer = "training_config" in f.attrs
    except OSError:
        return  # missing or not HDF5: Keras reports it
    if has_optimizer:
        raise ValueError(
            f"load_model cannot restore the optimizer saved in the HDF5 file {filepath}: "
            "Keras 3 does not restore optimizers from .h5 files (their state is dropped and "
            "the loaded model cannot train). Save the model as .keras (model.save("
            "'model.keras')) and load that, or load the weights alone with "
            "keras.models.load_model(path, compile=False) and compile the model with a new "
            "hvd.DistributedOptimizer (the optimizer state starts afresh)")
