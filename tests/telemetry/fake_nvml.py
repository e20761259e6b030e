"""A fake `pynvml` module: the one boundary the GPU agent has with NVML.

It exposes pynvml's names (a test checks each exists in the real nvidia-ml-py) with pynvml's
behaviour where the agent depends on it: errors are NVMLError subclasses carrying the code,
handles are opaque objects, milliwatts for power, NVMLError_Timeout from an empty event set.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from types import ModuleType, SimpleNamespace
from typing import Any


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return NAMES.get(self.value, f"NVML Error with code {self.value}")


CODES = {"Uninitialized": 1, "NoPermission": 4, "NotSupported": 3, "Timeout": 10,
         "DriverNotLoaded": 9, "LibraryNotFound": 12, "GpuIsLost": 15, "Unknown": 999}
NAMES = {1: "Uninitialized", 3: "Not Supported", 4: "Insufficient Permissions",
         9: "Driver Not Loaded", 10: "Timeout", 12: "NVML Shared Library Not Found",
         15: "GPU is lost", 999: "Unknown Error"}


class NamedNVMLError(NVMLError):
    """pynvml's NVMLError_<Name>: raised without arguments, it carries its class's code."""

    code = 999

    def __init__(self, *args: Any) -> None:
        super().__init__(self.code)


def _error_class(name: str, code: int) -> type[NamedNVMLError]:
    named = type(f"NVMLError_{name}", (NamedNVMLError,), {"code": code})
    assert issubclass(named, NamedNVMLError)
    return named


ERRORS = {name: _error_class(name, code) for name, code in CODES.items()}


@dataclass
class FakeGpu:
    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    memory_total: int = 85_520_809_984
    memory_used: int = 1_048_576_000
    util_gpu: int = 37
    util_memory: int = 12
    temperature: int = 41
    power_mw: int = 118_250
    power_limit_mw: int = 700_000
    ecc_enabled: bool | None = True  # None: ECC not supported at all
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    events_supported: bool = True
    lost: bool = False
    unsupported: set[str] = field(default_factory=set)  # function names that answer NotSupported


class FakeNvml:
    """State of a fake machine; `module` is what the agent imports as `pynvml`."""

    def __init__(self, gpus: list[FakeGpu] | None = None, init_error: str | None = None) -> None:
        self.gpus = gpus if gpus is not None else [FakeGpu()]
        self.init_error = init_error
        self.events: deque[tuple[int, int]] = deque()  # (gpu index, xid)
        self.initialised = False
        self.shutdowns = 0
        self.registered: list[int] = []
        self.waits: list[int] = []
        self.module = self._module()

    def xid(self, index: int, code: int) -> None:
        self.events.append((index, code))

    def _gpu(self, handle: Any, fn: str) -> FakeGpu:
        if not self.initialised:
            raise ERRORS["Uninitialized"]()
        gpu = self.gpus[handle.index]
        if gpu.lost:
            raise ERRORS["GpuIsLost"]()
        if fn in gpu.unsupported:
            raise ERRORS["NotSupported"]()
        return gpu

    def _module(self) -> ModuleType:
        m = ModuleType("pynvml")
        # ModuleType takes any attribute at run time; its stub declares none to set.
        names = vars(m)
        names["NVMLError"] = NVMLError
        for name, cls in ERRORS.items():
            names[f"NVMLError_{name}"] = cls
        names.update(NVML_TEMPERATURE_GPU=0, NVML_VOLATILE_ECC=0,
                     NVML_MEMORY_ERROR_TYPE_CORRECTED=0, NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1,
                     nvmlEventTypeXidCriticalError=0x8)
        handles = [SimpleNamespace(index=i) for i in range(len(self.gpus))]

        def init() -> None:
            if self.init_error:
                raise ERRORS[self.init_error]()
            self.initialised = True

        def shutdown() -> None:
            self.initialised = False
            self.shutdowns += 1

        def ecc_mode(h: Any) -> list[int]:
            gpu = self._gpu(h, "nvmlDeviceGetEccMode")
            if gpu.ecc_enabled is None:
                raise ERRORS["NotSupported"]()
            return [int(gpu.ecc_enabled), int(gpu.ecc_enabled)]

        def ecc_errors(h: Any, kind: int, counter: int) -> int:
            gpu = self._gpu(h, "nvmlDeviceGetTotalEccErrors")
            assert counter == 0, "the agent reads volatile counters"
            return gpu.ecc_uncorrected if kind == 1 else gpu.ecc_corrected

        def register(h: Any, types: int, event_set: Any) -> None:
            gpu = self._gpu(h, "nvmlDeviceRegisterEvents")
            if not gpu.events_supported:
                raise ERRORS["NotSupported"]()
            assert types & 0x8 and event_set == "event-set"
            self.registered.append(h.index)

        def wait(event_set: Any, timeout_ms: int) -> Any:
            self.waits.append(timeout_ms)
            while self.events:
                index, code = self.events.popleft()
                if index in self.registered:
                    # pynvml hands back a new handle object with every event
                    return SimpleNamespace(device=SimpleNamespace(index=index), eventType=0x8, eventData=code,
                                           gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)
            raise ERRORS["Timeout"]()

        def count() -> int:
            if not self.initialised:
                raise ERRORS["Uninitialized"]()
            return len(self.gpus)

        names.update(
            nvmlInit=init,
            nvmlShutdown=shutdown,
            nvmlDeviceGetCount=count,
            nvmlDeviceGetHandleByIndex=lambda i: handles[i],
            nvmlDeviceGetIndex=lambda h: h.index,
            nvmlDeviceGetUUID=lambda h: self._gpu(h, "nvmlDeviceGetUUID").uuid,
            nvmlDeviceGetName=lambda h: self._gpu(h, "nvmlDeviceGetName").name.encode(),
            nvmlSystemGetDriverVersion=lambda: "550.54.15",
            nvmlSystemGetNVMLVersion=lambda: "12.550.54.15",
            nvmlSystemGetCudaDriverVersion=lambda: 12040,
            nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(
                total=(g := self._gpu(h, "nvmlDeviceGetMemoryInfo")).memory_total,
                used=g.memory_used, free=g.memory_total - g.memory_used),
            nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(
                gpu=(g := self._gpu(h, "nvmlDeviceGetUtilizationRates")).util_gpu, memory=g.util_memory),
            nvmlDeviceGetTemperature=lambda h, sensor: self._gpu(
                h, "nvmlDeviceGetTemperature").temperature,
            nvmlDeviceGetPowerUsage=lambda h: self._gpu(h, "nvmlDeviceGetPowerUsage").power_mw,
            nvmlDeviceGetEnforcedPowerLimit=lambda h: self._gpu(
                h, "nvmlDeviceGetEnforcedPowerLimit").power_limit_mw,
            nvmlDeviceGetEccMode=ecc_mode,
            nvmlDeviceGetTotalEccErrors=ecc_errors,
            nvmlEventSetCreate=lambda: "event-set",
            nvmlDeviceRegisterEvents=register,
            nvmlEventSetWait=wait,
            nvmlEventSetFree=lambda event_set: None,
        )
        return m
