"""detect_hardware on a fake NVML: a node of identical GPUs, CUDA_VISIBLE_DEVICES, mixed models, MIG. Fakes: tests/harness/nvml.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness.contracts import mismatches
from harness.nvml import (
    A100_80,
    A100_80_MEMORY,
    H100,
    H100_MEMORY,
    MIB,
    MIG_1G,
    MIG_1G_MEMORY,
    MIG_3G,
    MIG_3G_MEMORY,
    MIG_UUIDS,
    UUIDS,
    FakeGpu,
    FakeNvml,
    gpus_of,
    h100s,
    mig_gpu,
    run_detect,
    uuids,
)

from stagetrain.errors import StageError
from stagetrain.hardware.report import HardwareReport
from stagetrain.hardware.visible import Device, select_visible

# --------------------------------------------------------------------------------------
# NVML: a node of identical GPUs
# --------------------------------------------------------------------------------------


class TestNvmlNode:
    """Eight H100s through NVML: summary, versions, NVLink, init/shutdown pairing."""

    def test_eight_h100s(self, tmp_path: Path) -> None:
        """Every field of the GPU summary comes from NVML."""
        nvml = h100s(8)
        result = run_detect(nvml, tmp_path)
        assert result["source"] == "nvml"
        assert result["fallbacks"] == []
        assert result["warnings"] == []
        assert result["gpus_per_node"] == 8
        assert result["cpu_ranks"] is None
        assert result["cuda_visible_devices"] is None
        gpu = result["gpu"]
        assert gpu["key"] == "H100"
        assert gpu["name"] == H100
        assert gpu["memory_bytes"] == H100_MEMORY
        assert gpu["compute_capability"] == "9.0"
        assert gpu["nvlink"] is True
        assert gpu["mig"] is False
        assert gpu["spec"]["key"] == "H100"
        assert gpu["spec"]["bf16_tflops"] == 989.5
        assert result["driver_version"] == "550.54.15"
        assert result["cuda_driver_version"] == "12.4"
        assert uuids(result) == UUIDS
        assert [d["index"] for d in result["devices"]] == list(range(8))
        assert nvml.calls[0] == "nvmlInit"
        assert nvml.calls[-1] == "nvmlShutdown"
        # The GPU side of hardware.json, which the default run (CPU) never writes, is what
        # its type declares: the catalog entry and the devices included.
        assert mismatches(result, HardwareReport) == []

    def test_memory_is_the_smallest_visible(self, tmp_path: Path) -> None:
        """Same model, different reported totals: plan for the smallest."""
        gpus = gpus_of(H100, 2)
        gpus[1].memory_bytes = H100_MEMORY - 512 * MIB
        result = run_detect(FakeNvml(gpus), tmp_path)
        assert result["gpu"]["memory_bytes"] == H100_MEMORY - 512 * MIB

    def test_nvlink_false_when_links_inactive(self, tmp_path: Path) -> None:
        """NVLink-capable GPUs whose links are all down report no NVLink."""
        assert run_detect(h100s(8, nvlink=False), tmp_path)["gpu"]["nvlink"] is False

    def test_nvlink_false_when_state_raises(self, tmp_path: Path) -> None:
        """nvmlDeviceGetNvLinkState raising NVMLError (no NVLink) is not a failure."""
        result = run_detect(h100s(8, nvlink=None), tmp_path)
        assert result["source"] == "nvml"
        assert result["fallbacks"] == []
        assert result["gpu"]["nvlink"] is False

    @pytest.mark.parametrize(
        ("cuda", "expected"),
        [(12040, "12.4"), (11080, "11.8"), (12090, "12.9"), (13000, "13.0"), (12020, "12.2")],
    )
    def test_cuda_driver_version(self, tmp_path: Path, cuda: int, expected: str) -> None:
        """NVML's integer CUDA version (1000 * major + 10 * minor) becomes 'major.minor'."""
        nvml = FakeNvml(gpus_of(H100, 1), cuda=cuda)
        assert run_detect(nvml, tmp_path)["cuda_driver_version"] == expected

    def test_bytes_from_old_bindings_are_decoded(self, tmp_path: Path) -> None:
        """Older pynvml returns bytes for names, UUIDs and the driver version."""
        gpu = FakeGpu(name=H100.encode(), uuid=UUIDS[0].encode(), memory_bytes=H100_MEMORY)
        result = run_detect(FakeNvml([gpu], driver=b"535.104.05"), tmp_path)
        assert result["gpu"]["name"] == H100
        assert result["gpu"]["key"] == "H100"
        assert uuids(result) == [UUIDS[0]]
        assert result["driver_version"] == "535.104.05"

    def test_zero_gpus_falls_back_to_cpu(self, tmp_path: Path) -> None:
        """NVML working but seeing no GPU: CPU, with a reason that does not blame the variable."""
        result = run_detect(FakeNvml([]), tmp_path)
        assert result["source"] == "cpu"
        assert result["gpu"] is None
        assert result["gpus_per_node"] == 0
        assert result["fallbacks"] == ["nvml: no usable GPU"]


# --------------------------------------------------------------------------------------
# CUDA_VISIBLE_DEVICES
# --------------------------------------------------------------------------------------


class TestCudaVisibleDevices:
    """CUDA_VISIBLE_DEVICES read as the CUDA runtime reads it, through detect()."""

    @pytest.mark.parametrize(
        ("value", "count", "expected"),
        [
            ("2,0", 8, [UUIDS[2], UUIDS[0]]),
            ("7", 8, [UUIDS[7]]),
            ("0,7,1", 4, [UUIDS[0]]),  # 7 is out of range: the list ends there
            ("0,abc,1", 8, [UUIDS[0]]),  # not a device: the list ends there
            ("1,-1,2", 8, [UUIDS[1]]),
            ("0,,1", 8, [UUIDS[0]]),
            ("0,\u00b2", 8, [UUIDS[0]]),  # a superscript digit is not an index
            ("GPU-5b0f", 8, [UUIDS[0]]),  # unique UUID prefix
            ("GPU-5b1e0d47,3", 8, [UUIDS[1], UUIDS[3]]),
            (UUIDS[5], 8, [UUIDS[5]]),  # a full UUID
            ("3,GPU-5b,2", 8, [UUIDS[3]]),  # ambiguous prefix: the list ends there
            ("1,GPU-00000000,2", 8, [UUIDS[1]]),  # unknown UUID
            ("1,MIG-1d2c3b4a", 8, [UUIDS[1]]),  # no MIG instance by that UUID
        ],
    )
    def test_selection(self, tmp_path: Path, value: str, count: int, expected: list[str]) -> None:
        """The visible devices, in the order CUDA would number them."""
        result = run_detect(h100s(count), tmp_path, {"CUDA_VISIBLE_DEVICES": value})
        assert result["source"] == "nvml"
        assert result["cuda_visible_devices"] == value
        assert uuids(result) == expected
        assert result["gpus_per_node"] == len(expected)

    def test_order_keeps_physical_index(self, tmp_path: Path) -> None:
        """'2,0' renumbers the devices but each keeps its NVML index."""
        result = run_detect(h100s(8), tmp_path, {"CUDA_VISIBLE_DEVICES": "2,0"})
        assert [d["index"] for d in result["devices"]] == [2, 0]

    @pytest.mark.parametrize("value", ["", "-1", "8", "GPU-5b", "none"])
    def test_hiding_every_gpu_falls_back_to_cpu(self, tmp_path: Path, value: str) -> None:
        """No visible device: source 'cpu', the reason recorded, NVML facts kept."""
        result = run_detect(h100s(8), tmp_path, {"CUDA_VISIBLE_DEVICES": value})
        assert result["source"] == "cpu"
        assert result["fallbacks"] == [f"nvml: CUDA_VISIBLE_DEVICES={value!r} hides every GPU"]
        assert result["gpu"] is None
        assert result["devices"] == []
        assert result["gpus_per_node"] == 0
        assert result["cpu_ranks"] == 2
        assert result["driver_version"] == "550.54.15"

    @pytest.mark.parametrize("value", ["1,1", "0,2,0", f"0,{UUIDS[0][:10]}", "GPU-5b0f,0"])
    def test_device_listed_twice_is_an_error(self, tmp_path: Path, value: str) -> None:
        """CUDA refuses a device named twice (by index or UUID); so does detection."""
        with pytest.raises(StageError, match="listed twice") as caught:
            run_detect(h100s(8), tmp_path, {"CUDA_VISIBLE_DEVICES": value})
        assert repr(value) in str(caught.value)
        assert "\n" not in str(caught.value)

    def test_duplicate_after_the_end_is_ignored(self, tmp_path: Path) -> None:
        """Entries after the first invalid one are never read, duplicates included."""
        result = run_detect(h100s(8), tmp_path, {"CUDA_VISIBLE_DEVICES": "0,x,0"})
        assert uuids(result) == [UUIDS[0]]


class TestSelectVisible:
    """select_visible on its own: the unset case and MIG stand-ins."""

    GPUS = [
        Device(
            index=i, name=H100, uuid=UUIDS[i], memory_bytes=H100_MEMORY, compute_capability="9.0"
        )
        for i in range(3)
    ]
    MIGS = [
        Device(
            index=1,
            name=MIG_1G,
            uuid=MIG_UUIDS[i],
            memory_bytes=MIG_1G_MEMORY,
            compute_capability="9.0",
            mig=True,
            parent_uuid=UUIDS[1],
        )
        for i in range(2)
    ]

    def test_unset_is_every_gpu_in_order(self) -> None:
        """Unset: every GPU in enumeration order."""
        assert select_visible(None, self.GPUS) == self.GPUS

    def test_unset_puts_mig_instances_in_place_of_their_gpu(self) -> None:
        """Unset: a MIG-enabled GPU is replaced, in place, by its instances."""
        chosen = select_visible(None, self.GPUS, self.MIGS)
        assert [d.uuid for d in chosen] == [UUIDS[0], MIG_UUIDS[0], MIG_UUIDS[1], UUIDS[2]]

    def test_mig_uuid_prefix(self) -> None:
        """MIG-<uuid> prefixes select among the instances only."""
        chosen = select_visible("MIG-7f6e,0", self.GPUS, self.MIGS)
        assert [d.uuid for d in chosen] == [MIG_UUIDS[1], UUIDS[0]]

    def test_gpu_prefix_does_not_match_mig(self) -> None:
        """A GPU- entry never names a MIG instance, nor a MIG- entry a GPU."""
        assert select_visible("GPU-" + MIG_UUIDS[0][4:], self.GPUS, self.MIGS) == []
        assert select_visible("MIG-" + UUIDS[0][4:], self.GPUS, self.MIGS) == []


# --------------------------------------------------------------------------------------
# Mixed GPU models
# --------------------------------------------------------------------------------------


class TestMixedModels:
    """Visible GPUs of different models are refused; restricting to one model works."""

    @staticmethod
    def mixed() -> FakeNvml:
        """Two H100s (0, 1) and two A100 80GB (2, 3)."""
        a100s = [
            FakeGpu(
                name=A100_80,
                uuid=UUIDS[i],
                memory_bytes=A100_80_MEMORY,
                compute_capability=(8, 0),
            )
            for i in (2, 3)
        ]
        return FakeNvml([*gpus_of(H100, 2), *a100s])

    def test_mixed_is_one_line_error_naming_both(self, tmp_path: Path) -> None:
        """The message is one line and names both models and every device."""
        with pytest.raises(StageError) as caught:
            run_detect(self.mixed(), tmp_path)
        message = str(caught.value)
        assert "\n" not in message
        assert "different models" in message
        assert H100 in message
        assert A100_80 in message
        for uuid in UUIDS[:4]:
            assert uuid in message

    def test_visible_pair_of_two_models_is_an_error(self, tmp_path: Path) -> None:
        """Selecting one of each is as wrong as seeing all of them."""
        with pytest.raises(StageError, match="different models"):
            run_detect(self.mixed(), tmp_path, {"CUDA_VISIBLE_DEVICES": "1,2"})

    @pytest.mark.parametrize(
        ("value", "key", "memory", "capability"),
        [
            ("2,3", "A100-80GB", A100_80_MEMORY, "8.0"),
            ("0,1", "H100", H100_MEMORY, "9.0"),
            ("3", "A100-80GB", A100_80_MEMORY, "8.0"),
        ],
    )
    def test_restricting_to_one_model(
        self, tmp_path: Path, value: str, key: str, memory: int, capability: str
    ) -> None:
        """CUDA_VISIBLE_DEVICES naming one model's GPUs gives that model's summary."""
        result = run_detect(self.mixed(), tmp_path, {"CUDA_VISIBLE_DEVICES": value})
        assert result["gpu"]["key"] == key
        assert result["gpu"]["memory_bytes"] == memory
        assert result["gpu"]["compute_capability"] == capability
        assert result["gpus_per_node"] == len(value.split(","))


# --------------------------------------------------------------------------------------
# MIG
# --------------------------------------------------------------------------------------


class TestMig:
    """MIG-enabled GPUs: usable only through their instances."""

    def test_unset_instances_stand_in(self, tmp_path: Path) -> None:
        """With the variable unset the instances are the devices; empty slots are skipped."""
        nvml = FakeNvml([mig_gpu((MIG_1G, MIG_1G_MEMORY), (MIG_1G, MIG_1G_MEMORY))])
        result = run_detect(nvml, tmp_path)
        assert result["source"] == "nvml"
        assert result["warnings"] == []
        assert result["gpus_per_node"] == 2
        assert uuids(result) == MIG_UUIDS[:2]
        assert all(d["mig"] and d["parent_uuid"] == UUIDS[0] for d in result["devices"])
        assert all(d["compute_capability"] == "9.0" for d in result["devices"])
        gpu = result["gpu"]
        assert gpu["mig"] is True
        assert gpu["name"] == MIG_1G
        assert gpu["memory_bytes"] == MIG_1G_MEMORY
        assert gpu["key"] is None  # a slice runs at a fraction of the catalog's peak
        assert gpu["spec"] is None

    def test_gpu_selected_by_index_is_skipped_with_a_warning(self, tmp_path: Path) -> None:
        """Index 0 names a MIG-enabled GPU: skipped, named in a warning; index 1 kept."""
        nvml = FakeNvml([mig_gpu((MIG_1G, MIG_1G_MEMORY)), gpus_of(H100, 2)[1]])
        result = run_detect(nvml, tmp_path, {"CUDA_VISIBLE_DEVICES": "0,1"})
        assert result["source"] == "nvml"
        assert uuids(result) == [UUIDS[1]]
        assert result["gpu"]["key"] == "H100"
        assert len(result["warnings"]) == 1
        assert UUIDS[0] in result["warnings"][0]
        assert "MIG" in result["warnings"][0]

    def test_gpu_selected_by_uuid_is_skipped(self, tmp_path: Path) -> None:
        """Naming the MIG-enabled GPU by UUID is skipped the same way."""
        nvml = FakeNvml([mig_gpu((MIG_1G, MIG_1G_MEMORY)), gpus_of(H100, 2)[1]])
        result = run_detect(nvml, tmp_path, {"CUDA_VISIBLE_DEVICES": "GPU-5b0f,1"})
        assert uuids(result) == [UUIDS[1]]
        assert UUIDS[0] in result["warnings"][0]

    def test_only_a_mig_gpu_selected_leaves_the_cpu(self, tmp_path: Path) -> None:
        """Skipping the only selected GPU leaves nothing: CPU, with warning and reason."""
        nvml = FakeNvml([mig_gpu((MIG_1G, MIG_1G_MEMORY)), gpus_of(H100, 2)[1]])
        result = run_detect(nvml, tmp_path, {"CUDA_VISIBLE_DEVICES": "0"})
        assert result["source"] == "cpu"
        assert UUIDS[0] in result["warnings"][0]
        assert result["fallbacks"] == ["nvml: CUDA_VISIBLE_DEVICES='0' hides every GPU"]

    def test_mig_uuid_selects_an_instance(self, tmp_path: Path) -> None:
        """MIG-<uuid> selects that instance; its memory is the instance's memory."""
        gpu = mig_gpu((MIG_1G, MIG_1G_MEMORY), (MIG_3G, MIG_3G_MEMORY))
        result = run_detect(FakeNvml([gpu]), tmp_path, {"CUDA_VISIBLE_DEVICES": MIG_UUIDS[1]})
        assert uuids(result) == [MIG_UUIDS[1]]
        assert result["devices"][0]["parent_uuid"] == UUIDS[0]
        assert result["gpu"]["name"] == MIG_3G
        assert result["gpu"]["memory_bytes"] == MIG_3G_MEMORY
        assert result["gpu"]["mig"] is True
        assert result["warnings"] == []

    def test_instances_of_different_profiles_are_different_models(self, tmp_path: Path) -> None:
        """A 1g.10gb and a 3g.40gb slice are not one model."""
        gpu = mig_gpu((MIG_1G, MIG_1G_MEMORY), (MIG_3G, MIG_3G_MEMORY))
        with pytest.raises(StageError, match="different models"):
            run_detect(FakeNvml([gpu]), tmp_path)

    def test_mig_gpu_without_instances_is_skipped(self, tmp_path: Path) -> None:
        """MIG mode on, no instance created: nothing usable, and the warning says why."""
        result = run_detect(FakeNvml([mig_gpu()]), tmp_path)
        assert result["source"] == "cpu"
        assert UUIDS[0] in result["warnings"][0]

    def test_mig_capable_but_disabled_is_a_whole_gpu(self, tmp_path: Path) -> None:
        """nvmlDeviceGetMigMode answering (0, 0): an ordinary GPU."""
        gpus = gpus_of(A100_80, 2, A100_80_MEMORY, compute_capability=(8, 0), mig_mode=False)
        result = run_detect(FakeNvml(gpus), tmp_path)
        assert result["gpu"]["key"] == "A100-80GB"
        assert result["gpu"]["mig"] is False
        assert uuids(result) == UUIDS[:2]
        assert result["warnings"] == []
