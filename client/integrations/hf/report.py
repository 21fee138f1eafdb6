"""What kernelize leaves on the model: `model.kernel_service`."""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass
class Report:
    """`model.kernel_service` after kernelize: what was asked, chosen, swapped and kept."""

    requested: str
    backend: str = "eager"
    reason: str = ""  # why the backend is not the one requested (or auto's choice)
    swapped: dict = dataclasses.field(default_factory=dict)  # module name -> kind
    kept: dict = dataclasses.field(default_factory=dict)  # module name -> why it keeps its own forward
    calls: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # kind -> eager calls served
    fallbacks: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # kind -> calls that ran the module's own forward
    original_attn: str | None = None
    strict: bool = False  # a call the kernels do not serve raises instead of running the module's own forward
    warned_grad: bool = dataclasses.field(default=False, repr=False)  # the grad-mode warning, given once per model
    graphs: object = None  # with kernelize(graphs=...): a graphs.GraphStats (buckets captured, replays, calls uncaptured)
    kernels: list = dataclasses.field(default_factory=list, repr=False)  # the kernels served, routers among them

    def ready(self, timeout: float | None = None) -> Report:
        """Waits until every router's builds are loaded (they load in the background after a cold
        kernelize: until then a call in a cold range runs the router's last range's build).
        Raises what loading met, TimeoutError past `timeout` seconds."""
        for k in self.kernels:
            k.ready(timeout)
        return self
