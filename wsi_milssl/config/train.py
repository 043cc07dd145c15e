"""Settings of MIL-SSL training (``wsi-milssl train``) and of the MIL CSV benchmark.

Fields left as ``None`` take the default of the training ``mode`` when the config is built, so the
resolved config (written beside every run and into every checkpoint) always holds concrete values:

==============  ==================  ====================
field           mode="images"       mode="features"
==============  ==================  ====================
model           resnet18            mlp
optimizer       sgd (momentum 0.9)  adam
lr              1e-3                1e-3
batch_size      64                  512
epochs          10                  100
mu_ramp_epochs  5                   10
==============  ==================  ====================

SGD at 1e-3 and batch 64 are the paper's image settings. T (``mu_ramp_epochs``, eq. 10) is half the image
mode's default epochs, so μ_t reaches μ with epochs to spare (T = 10 with 10 epochs never reached it). For feature heads an epoch is only a few
steps and SGD at 1e-3 hardly moves the weights (measured on MUSK1; see ``docs/method.md``), so the
feature mode defaults to Adam.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
from dataclasses import dataclass

from wsi_milssl.config.base import check_choice, coerce_float_fields, check_range, check_type
from wsi_milssl.errors import ConfigError

__all__ = ["TrainConfig", "MODE_DEFAULTS", "BenchmarkConfig", "RUNTIME_ONLY_FIELDS", "BAG_POOLINGS",
           "BUILTIN_MODELS", "LAM_MAX", "check_lam", "model_kinds"]

#: ``TrainConfig.bag_pooling``: how a bag's score comes from its instance probabilities (paper eq. 11); training,
#: the CLI and the heatmap models that read a checkpoint accept these
BAG_POOLINGS = ("max", "mean")

#: ``TrainConfig.compile``: off, or a ``torch.compile`` mode.
COMPILE_MODES = ("off", "default", "reduce-overhead")
#: TrainConfig fields that may differ between a run and its resume without changing the result.
RUNTIME_ONLY_FIELDS = ("num_workers", "threads", "plots", "device", "eval_batch_size", "decode", "compile")

MODE_DEFAULTS: dict[str, dict[str, object]] = {
    "images": {"model": "resnet18", "optimizer": "sgd", "lr": 1e-3, "batch_size": 64, "epochs": 10,
               "mu_ramp_epochs": 5},
    "features": {"model": "mlp", "optimizer": "adam", "lr": 1e-3, "batch_size": 512, "epochs": 100,
                 "mu_ramp_epochs": 10},
}


def _plain_numbers(config) -> None:
    """Replace numpy scalars in ``config``'s fields (and in its tuples) by the Python int or float they hold.

    np.float32 is no subclass of float, nor np.int64 of int (np.float64 is a float), so the type checks
    would refuse a μ of np.float32(0.3) that a float passes; and the resolved config is written as JSON.
    Booleans (numpy's too) are left alone, so a bool field still takes only a bool.
    """

    def plain(value):
        if isinstance(value, bool) or type(value) in (int, float):
            return value
        if isinstance(value, numbers.Integral):
            return int(value)
        if isinstance(value, numbers.Real):
            return float(value)
        return value

    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        value = tuple(plain(v) for v in value) if isinstance(value, tuple) else plain(value)
        object.__setattr__(config, field.name, value)


#: The largest λ accepted. λ → ∞ is the unregularised problem (eq. 4), and at λ = 1e6 the labels are
#: already 0 or 1 for every instance more than about 1e-5 in logit from the cut, so a larger λ changes
#: nothing useful; from about 1e15 float64 can no longer place the cut (Sinkhorn stops short of its
#: tolerance), and near 1e307 λ log p (|log p| <= 27.6 with p clipped to
#: :data:`wsi_milssl.mil.sinkhorn.PROB_EPS`) overflows and every label is NaN (measured on 2,000 uniform
#: probabilities).
LAM_MAX = 1e6

#: The Sinkhorn solver meets a tolerance on the positive share |Σ q / N - μ| no finer than this: float64 sums of
#: up to millions of labels round at up to about 1e-14 of the share (review EB measured 9e-15), so a finer
#: tolerance might never be met, and every refresh would run all ``sinkhorn_max_iter`` iterations and warn
#: (review DY). A finer ``sinkhorn_tol`` is accepted (runs saved with one resume) and met at this level.
SINKHORN_TOL_FLOOR = 1e-13


def check_lam(lam, where: str = "lam") -> float:
    """``lam`` as a float, or a ConfigError naming ``where`` unless 0 < lam <= :data:`LAM_MAX`."""
    if not (isinstance(lam, numbers.Real) and not isinstance(lam, bool) and 0.0 < float(lam) <= LAM_MAX):
        raise ConfigError(
            f"{where} (the entropic-regularisation λ) must satisfy 0 < λ <= {LAM_MAX:g}; got {lam!r}. Near "
            f"1e307 λ log p overflows float64 (NaN labels), and at {LAM_MAX:g} the labels are already 0/1 but "
            f"for instances within about 1e-5 in logit of the cut, so a larger λ changes nothing useful. "
            f"Use a λ in that range (the paper's is 25)."
        )
    return float(lam)


#: The largest learning rate and weight decay accepted: well inside float32 (review CX: values above its range crashed
#: the optimizer with a traceback; 1e30 already diverges with the usual error).
LR_MAX = 1e30
#: The most epochs (and warm-up or μ-ramp epochs) a run may ask for: a million feature-head epochs is already days;
#: 10**30 was accepted and ran until killed.
MAX_EPOCHS = 1_000_000
#: Built-in models that ignore ``hidden_dims`` and ``dropout`` (the mlp head's): a value other than the default is
#: said and replaced by it, so that it is not recorded as a change of the run.
WITHOUT_HIDDEN_LAYERS = ("resnet18", "linear")
#: The built-in models and whether each takes image patches (True) or feature vectors (False), as
#: :mod:`wsi_milssl.mil.models` and :mod:`wsi_milssl.benchmark.baselines` register them (a test checks that
#: they agree): the settings are checked without importing torch (review CH: every `run` imported it).
BUILTIN_MODELS: dict[str, bool] = {"resnet18": True, "linear": False, "mlp": False, "digit-cnn": False,
                                   "digit-cnn-shift": False}


_IGNORED_SAID: set[tuple[str, str]] = set()


def _say_ignored(model: str, settings: list[str]) -> None:
    """Warn once per process and value that ``settings`` (mlp head settings) take no effect on ``model``."""
    key = (model, ", ".join(settings))
    if key not in _IGNORED_SAID:
        _IGNORED_SAID.add(key)
        logging.getLogger(__name__).warning(
            "model %r has no hidden layers or dropout (mlp has), so %s take(s) no effect: the run records the "
            "defaults (a change of them trains nothing again). Fix: drop them, or train model = \"mlp\" on "
            "features.", model, " and ".join(settings))


def model_kinds() -> dict[str, bool]:
    """{model name: takes image patches} of the built-in models, and of every registered one once the model
    registry has been imported (as code that registers its own model has)."""
    import sys

    models = sys.modules.get("wsi_milssl.mil.models")
    if models is None:
        return dict(BUILTIN_MODELS)
    return {n: models.is_image_model(n) for n in models.list_models()}


@dataclass(frozen=True)
class TrainConfig:
    """MIL-SSL training (paper eq. 2-11).

    Pseudo labels: ``mu`` is the expected positive-instance ratio in positive bags (eq. 5), reached by
    the adaptive schedule μ_t = 0.5 + (μ - 0.5) t / T over ``mu_ramp_epochs`` = T epochs (eq. 10) unless
    ``fixed_mu``; ``lam`` is the entropic λ (eq. 6), at most ``LAM_MAX`` = 1e6
    (:mod:`wsi_milssl.mil.sinkhorn`); ``soft_labels``, ``global_constraint`` and ``local_constraint``
    are the table-8 ablation switches. Pseudo labels refresh every epoch, or every
    ``refresh_every`` optimizer steps when > 0; the first ``warmup_epochs`` epochs (default 0, the paper)
    train with every positive-bag instance labelled 1 before the first refresh, so the first pseudo
    labels come from a model that has seen the bags rather than from a random one; ``online_pseudo_labels`` reuses the probabilities seen in
    the training pass instead of an extra forward pass. ``pseudo_negative_weight`` scales the negative
    part (1 - q) of a positive-bag instance's pseudo label in the loss: 1 is the paper's eq. 9; 0 lets
    positive bags teach positives only, so negatives come from the negative bags alone (the positive-
    unlabelled view: an instance of a positive bag is never trained towards negative on a guess).

    Runtime: ``device`` "auto" picks CUDA when present; ``amp`` "auto" uses bfloat16 autocast (CUDA with
    bf16 support, or the CPU for image models), float16 with a gradient scaler on older GPUs, and
    full precision for feature heads on the CPU. ``num_workers`` -1 picks the reader processes for image
    mode (CPUs - 2, at most 16, on CUDA; min(4, CPUs - 1) on the CPU with more than 2 CPUs; none
    otherwise; under torchrun divided by the ranks per machine, LOCAL_WORLD_SIZE); they live for the
    whole run. ``decode`` 'device' decodes stored JPEG patches on the
    training device (torchvision; nvJPEG on CUDA) instead of in the readers. ``threads`` 0 leaves
    torch's intra-op thread count alone. ``compile`` ('off', or the ``torch.compile`` mode 'default' or
    'reduce-overhead', which adds CUDA graphs) runs the training step's forward and backward through
    TorchInductor after a compilation of up to a minute at the start of the run; predictions (refresh,
    validation) stay eager. Same seed, same result run to run; against an eager run the weights differ
    by kernel rounding, and dropout masks (feature heads) are drawn differently. On one H100,
    'reduce-overhead' doubled the training pass at 224 px and 'default' slowed it (README "Speed").

    Selection: ``select_metric`` picks best.pt on the validation set: 'bag_auc' (slide labels; needs
    validation slides of both classes), 'bag_nll' (the bag loss on slide labels, defined with one class)
    or 'instance_auc', which reads the instance labels (from annotations) of the validation slides, the
    one use of instance labels in training: never give it the test slides. A validation set on which the
    metric is never defined is refused before training.

    Data order: image instances are visited in shuffled blocks of ``shuffle_block`` consecutive
    patches of one slide (shuffled within the block), so reads are sequential within a store; 1 is a
    uniform permutation (see :func:`wsi_milssl.mil.loader.block_order` for the effect on randomness).
    """

    mode: str = "images"
    model: str | None = None
    weights_path: str | None = None
    hidden_dims: tuple[int, ...] = (256,)
    dropout: float = 0.5
    epochs: int | None = None
    batch_size: int | None = None
    eval_batch_size: int = 512
    optimizer: str | None = None
    lr: float | None = None
    momentum: float = 0.9
    weight_decay: float = 1e-4
    scheduler: str = "none"
    mu: float = 0.15
    mu_ramp_epochs: int | None = None
    fixed_mu: bool = False
    lam: float = 25.0
    sinkhorn_max_iter: int = 1000
    sinkhorn_tol: float = 1e-6
    soft_labels: bool = True
    global_constraint: bool = True
    local_constraint: bool = True
    refresh_every: int = 0
    warmup_epochs: int = 0
    pseudo_negative_weight: float = 1.0
    online_pseudo_labels: bool = False
    bag_pooling: str = "max"
    augment: bool = True
    colour_jitter: float = 0.05
    shuffle_block: int = 16
    select_metric: str = "bag_auc"
    seed: int = 0
    device: str = "auto"
    amp: str = "auto"
    channels_last: bool = True
    num_workers: int = -1
    decode: str = "workers"
    compile: str = "off"
    threads: int = 0
    plots: bool = True

    def __post_init__(self) -> None:
        name = type(self).__name__
        _plain_numbers(self)
        coerce_float_fields(self)  # 10 and 10.0: the same config, the same digests
        check_choice(name, "mode", self.mode, tuple(MODE_DEFAULTS))
        for key, value in MODE_DEFAULTS[self.mode].items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)  # resolve the mode's default once, at construction
        check_type(name, "model", self.model, str)
        if self.weights_path is not None:
            check_type(name, "weights_path", self.weights_path, str)
        check_type(name, "hidden_dims", self.hidden_dims, tuple)
        for h in self.hidden_dims:
            check_type(name, "hidden_dims", h, int)
            check_range(name, "hidden_dims", h, low=1)
        check_range(name, "dropout", self.dropout, low=0.0, high=1.0, high_inclusive=False)
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        ignored = [key for key in ("hidden_dims", "dropout")
                   if self.model in WITHOUT_HIDDEN_LAYERS and getattr(self, key) != defaults[key]]
        if ignored:  # review CX: recorded as given, a changed value trained the same weights again; review CZ: a
            # refusal broke resumes of earlier runs and grids over model = ["linear", "mlp"]: they take no effect
            _say_ignored(self.model, [f"{key} {getattr(self, key)!r}" for key in ignored])
            for key in ignored:
                object.__setattr__(self, key, defaults[key])
        for field in ("epochs", "batch_size", "eval_batch_size"):
            check_type(name, field, getattr(self, field), int)
            check_range(name, field, getattr(self, field), low=1)
        for field in ("epochs", "mu_ramp_epochs", "warmup_epochs"):  # 10**30 ran until killed (review ES)
            check_range(name, field, getattr(self, field), high=MAX_EPOCHS)
        check_choice(name, "optimizer", self.optimizer, ("sgd", "adam", "adamw"))
        check_range(name, "lr", self.lr, low=0.0, low_inclusive=False, high=LR_MAX)
        check_range(name, "momentum", self.momentum, low=0.0, high=1.0, high_inclusive=False)
        check_range(name, "weight_decay", self.weight_decay, low=0.0, high=LR_MAX)
        check_choice(name, "scheduler", self.scheduler, ("none", "cosine"))
        check_range(name, "mu", self.mu, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
        check_type(name, "mu_ramp_epochs", self.mu_ramp_epochs, int)
        check_range(name, "mu_ramp_epochs", self.mu_ramp_epochs, low=0)
        check_type(name, "lam", self.lam, (int, float))
        check_lam(self.lam, where=f"{name}.lam")  # 0 < λ <= LAM_MAX, with the reason
        check_type(name, "sinkhorn_max_iter", self.sinkhorn_max_iter, int)
        check_range(name, "sinkhorn_max_iter", self.sinkhorn_max_iter, low=1)
        check_range(name, "sinkhorn_tol", self.sinkhorn_tol, low=0.0, low_inclusive=False, high=1.0)  # a share
        for field in ("fixed_mu", "soft_labels", "global_constraint", "local_constraint",
                      "online_pseudo_labels", "augment", "channels_last", "plots"):
            check_type(name, field, getattr(self, field), bool)
        check_type(name, "refresh_every", self.refresh_every, int)
        check_range(name, "refresh_every", self.refresh_every, low=0)
        check_type(name, "warmup_epochs", self.warmup_epochs, int)
        check_range(name, "warmup_epochs", self.warmup_epochs, low=0)
        check_range(name, "pseudo_negative_weight", self.pseudo_negative_weight, low=0.0, high=1.0)
        check_choice(name, "bag_pooling", self.bag_pooling, BAG_POOLINGS)
        check_range(name, "colour_jitter", self.colour_jitter, low=0.0, high=0.5)
        check_choice(name, "select_metric", self.select_metric, ("bag_auc", "instance_auc", "bag_nll"))
        check_type(name, "seed", self.seed, int)
        check_range(name, "seed", self.seed, low=0)
        check_choice(name, "device", self.device, ("auto", "cpu", "cuda"))
        check_choice(name, "amp", self.amp, ("auto", "off", "bf16", "fp16"))
        check_type(name, "shuffle_block", self.shuffle_block, int)
        check_range(name, "shuffle_block", self.shuffle_block, low=1)
        check_choice(name, "decode", self.decode, ("workers", "device"))
        check_choice(name, "compile", self.compile, COMPILE_MODES)
        check_type(name, "num_workers", self.num_workers, int)
        check_range(name, "num_workers", self.num_workers, low=-1, high=256)  # as heatmap's and features'

        check_type(name, "threads", self.threads, int)
        check_range(name, "threads", self.threads, low=0, high=1024)  # torch crashes far above (review CX)
        kinds = model_kinds()
        check_choice(name, "model", self.model, tuple(sorted(kinds)), registry="register_model")
        if self.model == "resnet18" and self.batch_size < 2:  # review CX: torch's BatchNorm error mid-run
            raise ConfigError(f"{name}.batch_size must be 2 or more for model 'resnet18' (its BatchNorm layers cannot "
                              f"normalise a batch of one); got {self.batch_size}. Fix: batch_size 2 or more.")
        if kinds[self.model] != (self.mode == "images"):
            fix = ("model 'resnet18' for patch images, or, for a feature head, mode 'features' with feature files as "
                   "its input (`wsi-milssl features` makes them from patch stores)" if self.mode == "images" else
                   "model 'linear' or 'mlp' for features, or mode 'images' with patch stores as its input")
            raise ConfigError(f"{name}.model {self.model!r} does not take {self.mode}. Fix: {fix}.")


@dataclass(frozen=True)
class BenchmarkConfig:
    """The classical MIL benchmark protocol (``wsi-milssl benchmark mil-csv``).

    Stratified ``folds``-fold cross-validation over bags, ``repeats`` times (other seeds). Every method
    of ``methods`` (names of :data:`wsi_milssl.benchmark.mil_csv.METHODS`, or ``mil-ssl`` = the MIL-SSL
    ``preset``) runs in the same outer and inner folds: inside each training split an ``inner_folds``-fold
    grid search over the method's own grid picks its setting and epochs by ``select_metric`` ("auc" or
    "accuracy" of the out-of-fold bag scores) and calibrates the bag threshold; the test fold is never
    seen. ``mu_grid``, ``ramp_grid``, ``lr_grid`` and ``epoch_grid`` (when given) replace those grids of
    every method that searches them. ``threads`` > 0 sets torch's CPU threads.
    """

    folds: int = 10
    inner_folds: int = 3
    seed: int = 0
    repeats: int = 1
    methods: tuple[str, ...] = ("mil-ssl", "abmil", "gated-abmil", "maxpool")
    preset: str = "improved"
    mu_grid: tuple[float, ...] | None = None
    ramp_grid: tuple[int, ...] | None = None
    lr_grid: tuple[float, ...] | None = None
    epoch_grid: tuple[int, ...] | None = None
    select_metric: str = "auc"
    threads: int = 0

    def __post_init__(self) -> None:
        name = type(self).__name__
        _plain_numbers(self)
        coerce_float_fields(self)  # 10 and 10.0: the same config, the same digests
        for field in ("folds", "inner_folds"):
            check_type(name, field, getattr(self, field), int)
            check_range(name, field, getattr(self, field), low=2)
        check_type(name, "seed", self.seed, int)
        check_range(name, "seed", self.seed, low=0)
        check_type(name, "repeats", self.repeats, int)
        check_range(name, "repeats", self.repeats, low=1)
        check_type(name, "methods", self.methods, tuple)
        if not self.methods:
            raise ConfigError(f"{name}.methods must name at least one method; got ().")
        check_choice(name, "preset", self.preset, ("paper", "improved"))
        for field in ("mu_grid", "ramp_grid", "lr_grid", "epoch_grid"):
            value = getattr(self, field)
            if value is None:
                continue
            check_type(name, field, value, tuple)
            if not value:
                raise ConfigError(f"{name}.{field} must hold at least one value or be None; got ().")
        for mu in self.mu_grid or ():
            check_range(name, "mu_grid", mu, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
        for t in self.ramp_grid or ():
            check_type(name, "ramp_grid", t, int)
            check_range(name, "ramp_grid", t, low=0)
        for lr in self.lr_grid or ():
            check_range(name, "lr_grid", lr, low=0.0, low_inclusive=False, high=LR_MAX)
        for e in self.epoch_grid or ():
            check_type(name, "epoch_grid", e, int)
            check_range(name, "epoch_grid", e, low=1)
        check_choice(name, "select_metric", self.select_metric, ("accuracy", "auc"))
        check_type(name, "threads", self.threads, int)
        check_range(name, "threads", self.threads, low=0, high=1024)
        from wsi_milssl.benchmark.mil_csv import resolve_methods

        resolve_methods(self.methods, preset=self.preset)  # unknown or repeated names: ConfigError

    def grid_overrides(self) -> dict[str, tuple]:
        """The grids given here, by the method grid key they replace."""
        keys = {"mu_grid": "mu", "ramp_grid": "ramp_epochs", "lr_grid": "lr"}
        return {key: getattr(self, f) for f, key in keys.items() if getattr(self, f) is not None}

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)
