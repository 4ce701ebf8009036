"""The shim's memory, view and interception tests again, on the AddressSanitizer +
UndefinedBehaviorSanitizer build (native_build.build("asan")): the shim and the test programs
are instrumented, the simulator is the release build's. Any report ends a program with an
error, which fails the test it runs in."""

from __future__ import annotations

from pathlib import Path

import pytest
import test_shim_compute as compute
import test_shim_guarantee as guarantee
import test_shim_hostpid as hostpid
import test_shim_invariant as invariant
import test_shim_late_contexts as late
import test_shim_loading as loading
import test_shim_memory as memory
import test_shim_multiproc as multiproc
import test_shim_views as views
from test_shim_helpers import Shim

from vgpu_plugin.sim.simgpu import Node

pytestmark = pytest.mark.slow


@pytest.fixture
def asan(asan_tree: Path, simgpu_node: Node, tmp_path: Path) -> Shim:
    return Shim(asan_tree, simgpu_node, tmp_path)


@pytest.mark.parametrize("path", memory.PATHS)
def test_every_path(asan: Shim, path: str) -> None:
    memory.test_every_path_fills_the_limit_is_refused_past_it_and_frees_back(asan, path)


def test_arrays(asan: Shim) -> None:
    memory.test_arrays_are_charged_layers_faces_and_levels_and_sparse_ones_nothing(asan, "handle")


@pytest.mark.parametrize("mode", ["handle", "default", "getproc"])
def test_every_way_of_reaching_the_driver(asan: Shim, mode: str) -> None:
    memory.test_every_way_of_reaching_the_driver_is_enforced(asan, mode, "alloc")


def test_shared_limit_across_processes(asan: Shim) -> None:
    memory.test_processes_of_a_container_share_one_limit_and_free_back_to_zero(asan)


def test_killed_holder(asan: Shim) -> None:
    memory.test_a_killed_holders_memory_is_back_within_a_second(asan)


def test_bad_memory_limit(asan: Shim) -> None:
    memory.test_a_bad_memory_limit_fails_closed_with_one_line_naming_it(asan, "12x")


def test_bad_limits_file(asan: Shim) -> None:
    memory.test_a_bad_limits_file_refuses_everything_and_says_where(
        asan, "vgpu-limits 1\nbogus\n", "line 2"
    )


def test_limits_file(asan: Shim) -> None:
    memory.test_the_limits_file_wins_over_envs_and_follows_uuids_not_ordinals(asan)


def test_oversubscription(asan: Shim) -> None:
    memory.test_oversubscription_falls_back_to_managed_memory(asan)


def test_rtld_next_from_a_library(asan: Shim) -> None:
    loading.test_rtld_next_from_a_library_is_relative_to_that_library(asan)


def test_rtld_next_from_the_program(asan: Shim) -> None:
    loading.test_rtld_next_and_rtld_default_from_the_program(asan)


def test_get_proc_address(asan: Shim) -> None:
    loading.test_cu_get_proc_address_returns_hooks_of_the_drivers_variant(asan)


def test_get_proc_address_failures(asan: Shim) -> None:
    loading.test_cu_get_proc_address_passes_failures_and_status_through(asan)


def test_views(asan: Shim) -> None:
    views.test_every_view_reports_the_containers_share(asan)


def test_nvml_only_view(asan: Shim) -> None:
    views.test_an_nvml_only_process_sees_the_whole_containers_usage(asan)


@pytest.mark.parametrize("source", ["file", "env-uuids"])
def test_nvml_only_without_libcuda(asan: Shim, source: str) -> None:
    views.test_an_nvml_only_process_is_limited_without_loading_libcuda(asan, source)


@pytest.mark.parametrize("source", ["file", "env-uuids"])
def test_nvml_then_cuda(asan: Shim, source: str) -> None:
    views.test_a_gpu_seen_through_nvml_then_cuda_is_accounted_once(asan, source)


@pytest.mark.parametrize("limits,gpu0,gpu1", views.BY_INDEX)
def test_nvml_only_limits_by_index(
    asan: Shim, limits: dict[str, str], gpu0: int, gpu1: int
) -> None:
    views.test_an_nvml_only_process_with_limits_by_index_says_why_it_is_not_limited(
        asan, limits, gpu0, gpu1
    )


@pytest.mark.parametrize("limits,gpu0,gpu1", views.BY_INDEX)
def test_nvml_then_cuda_limits_by_index(
    asan: Shim, limits: dict[str, str], gpu0: int, gpu1: int
) -> None:
    views.test_limits_by_index_nvml_first_then_cuda_in_one_process(asan, limits, gpu0, gpu1)


@pytest.mark.parametrize("limits,gpu0,gpu1", views.BY_INDEX)
def test_cuinit_then_nvml_limits_by_index(
    asan: Shim, limits: dict[str, str], gpu0: int, gpu1: int
) -> None:
    views.test_limits_by_index_in_a_process_that_initialised_cuda_itself(asan, limits, gpu0, gpu1)


def test_contexts(asan: Shim) -> None:
    views.test_contexts_are_charged_and_given_back(asan)


def test_paced_launches(asan_tree: Path, tmp_path: Path) -> None:
    compute.test_every_launch_api_is_paced(asan_tree, tmp_path)


# Guarantees: the peers' files read, the private bucket, a tenant writing its own file.
def test_guaranteed_launches(asan_tree: Path, tmp_path: Path) -> None:
    guarantee.test_a_tenant_filling_its_own_budget_gets_no_more_than_its_guarantee(
        asan_tree, tmp_path
    )


# Time-slicing: the peers' queued work read and each kernel charged its share of the GPU.
def test_guaranteed_launches_time_sliced(asan_tree: Path, tmp_path: Path) -> None:
    guarantee.test_a_guarantee_holds_beside_a_busy_neighbour_on_a_time_sliced_gpu(
        asan_tree, tmp_path
    )


# The settle against the driver's samples, a real driver's periods apart, and its scale.
def test_guaranteed_launches_settled_by_the_drivers_samples(
    asan_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    guarantee.test_a_kernel_whose_duration_varies_gets_no_more_than_its_guarantee_time_sliced(
        asan_tree, tmp_path, "167", monkeypatch
    )


# The driver's measure of the container read and the private rates scaled by it.
def test_guaranteed_launches_of_several_processes(
    asan_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    multiproc.test_a_container_of_three_processes_forging_its_budget_keeps_to_its_guarantee(
        asan_tree, tmp_path, monkeypatch, "1000"
    )


# The invariant's paths (pools, contexts every way, graphs, NVML process lists, lock files).
def test_pool_then_another_path(asan: Shim) -> None:
    invariant.test_a_pool_that_keeps_its_cache_then_another_path_stays_within_the_limit(asan)


@pytest.mark.parametrize("how", ["runtime", "runtime_alloc"])
def test_context_made_past_the_shim(asan: Shim, how: str) -> None:
    invariant.test_a_context_made_past_the_shim_is_charged_when_first_met(asan, how)


def test_contexts_beside_neighbours(asan: Shim) -> None:
    invariant.test_contexts_are_charged_exactly_while_neighbours_allocate_and_free(asan)


def test_graph_memory(asan: Shim) -> None:
    invariant.test_graph_memory_nodes_are_charged_when_launched_and_refused_past_the_limit(asan)


@pytest.mark.parametrize("how", ["upload", "params"])
def test_graph_memory_uploaded(asan: Shim, how: str) -> None:
    invariant.test_graph_memory_given_before_a_launch_is_charged_before_the_driver_gives_it(
        asan, how
    )


def test_nvml_process_lists(asan: Shim) -> None:
    invariant.test_nvml_process_lists_show_only_the_containers_processes(asan)


def test_counters(asan: Shim) -> None:
    invariant.test_the_region_counts_refusals_fallbacks_peak_and_gpu_time(asan)


def test_leased_lock_file(asan: Shim, tmp_path: Path) -> None:
    invariant.test_a_leased_lock_file_does_not_stall_context_creation(asan, tmp_path)


def test_context_growth(asan: Shim) -> None:
    invariant.test_a_contexts_growth_is_charged_and_refused_past_the_limit(asan)


@pytest.mark.parametrize("how", ["runtime", "create"])
def test_own_pid_namespace(asan: Shim, tmp_path: Path, how: str) -> None:
    hostpid.test_a_container_in_its_own_pid_namespace_holds_no_more_than_its_limit(
        asan, tmp_path, how
    )


@pytest.mark.parametrize("mode", late.MODES)
def test_every_route_to_a_context_is_refused_before_it_is_made(asan: Shim, mode: str) -> None:
    with late.full_container(asan) as full:
        late.test_every_route_to_a_context_is_refused_before_it_is_made(asan, full, mode)
