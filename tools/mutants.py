"""Named one-line breaks of the pipeline's guarantees, and the tests that must catch each.

    python tools/mutants.py              # every mutant: caught / missed / stale, then a table
    python tools/mutants.py grpo-trains sampler-policy
    python tools/mutants.py --list

Each mutant is applied to a temporary copy of the working tree (tracked and untracked files
that git does not ignore), and its tests run there with the copy's `src/` first on the path;
the mutant is caught when they fail. The chosen mutants' tests first run once on the clean
tree: a mutant whose test fails there is reported broken, never caught. A mutant whose
`before` text is no longer found exactly once is stale: the code moved, and the list must
follow it. Run it before resolving an issue
that touches a guarded area, and give every new guarantee its mutant here.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from xml.etree import ElementTree

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    guarantee: str
    path: str
    before: str
    after: str
    tests: tuple[str, ...]


GRPO = "tests/test_grpo.py::"
SHARED = (
    "tests/test_grpo_sampling.py::test_completions_scored_over_their_shared_prompt_match_whole_rows"
)
TASKS = "tests/test_task_families.py::"
PUSH = "tests/test_publish_push.py::"
EP_GRPO = (
    "tests/test_experts.py::test_expert_parallelism_trains_as_one_rank_does_and_resumes_across_ep"
)
TYPES = "tests/test_lint.py::test_mypy_is_clean"
MUTANTS = (
    Mutant("zstd-truncation", "a .zst file cut short is refused, not read as a clean end of file",
           "src/stagetrain/tasks/files.py", '                    raise EOFError("truncated zstd stream")\n', "                    pass\n",
           (TASKS + "test_a_truncated_zstd_file_is_refused_not_read_short",
            "tests/test_corpus.py::test_a_cut_compressed_corpus_file_stops_the_stage_rather_than_adding_nothing")),
    Mutant("zstd-every-frame", "every zstandard frame of a file is read, not the first alone",
           "src/stagetrain/tasks/files.py", "        if self._frame is None or self._frame.eof:\n            self._frame =",
           "        if self._frame is None:\n            self._frame =",
           (TASKS + "test_a_truncated_zstd_file_is_refused_not_read_short",)),
    Mutant("line-bound", "no JSON line is read past MAX_LINE_BYTES",
           "src/stagetrain/tasks/files.py", "handle.readline(MAX_LINE_BYTES + 1)", "handle.readline()",
           (TASKS + "test_a_line_past_the_bound_is_refused_before_it_is_held",)),
    Mutant("line-bound-refused", "a line past MAX_LINE_BYTES is refused, not parsed cut",
           "src/stagetrain/tasks/files.py", "        if len(line) > MAX_LINE_BYTES:", "        if False:",
           (TASKS + "test_a_line_past_the_bound_is_refused_before_it_is_held",)),
    Mutant("success-at-positive", "success_at is above 0, so no bar is cleared by every completion",
           "workflow/schemas/config.schema.yaml", "        exclusiveMinimum: 0\n        default: 1.0\n", "        default: 1.0\n",
           (TASKS + "test_a_success_at_that_fakes_or_forbids_accuracy_is_refused",)),
    Mutant("success-at-weights", "a family whose every weight is 0 is refused",
           "src/stagetrain/config/settings.py", 'if rewards and all(r["weight"] == 0 for r in rewards):', "if False:",
           (TASKS + "test_a_success_at_that_fakes_or_forbids_accuracy_is_refused",)),
    Mutant("success-at-reachable", "a verifier family's success_at is at most its positive weights' sum",
           "src/stagetrain/config/settings.py", "sum(max(r[\"weight\"], 0.0) for r in rewards)", "sum(r[\"weight\"] for r in rewards)",
           (TASKS + "test_a_success_at_that_fakes_or_forbids_accuracy_is_refused",)),
    Mutant("success-at-builtin", "a success_at above 1 is refused where a built-in family is scored by it",
           "src/stagetrain/config/settings.py", "if builtin and self.tasks.success_at > 1:", "if False:",
           (TASKS + "test_a_success_at_that_fakes_or_forbids_accuracy_is_refused",)),
    Mutant("finite-task-level", "a NaN or infinite level or difficulty in a task row is refused",
           "src/stagetrain/tasks/families.py", "    if not math.isfinite(value):  # NaN compares", "    if False:  # NaN compares",
           (TASKS + "test_a_non_finite_answer_or_level_is_refused_by_row",)),
    Mutant("finite-task-answer", "a NaN or infinite answer in a task row is refused",
           "src/stagetrain/tasks/families.py", "        if not math.isfinite(value):  # JSON's NaN", "        if False:  # JSON's NaN",
           (TASKS + "test_a_non_finite_answer_or_level_is_refused_by_row",)),
    Mutant("prompt-specials", "a task prompt holding a special token of the tokenizer in use is refused",
           "src/stagetrain/tasks/prompts.py", "named |= {t.content for t in added if getattr(t, \"special\", False)}", "named |= set()",
           (TASKS + "test_a_task_row_cannot_inject_the_tokenizers_own_control_tokens",)),
    Mutant("chat-template-probe", "a chat template must render a probe question's text",
           "src/stagetrain/tasks/prompts.py", "        if PROBE not in self.tokenizer.decode(", "        if False and PROBE not in self.tokenizer.decode(",
           (TASKS + "test_a_chat_template_that_cannot_render_the_question_is_one_line",)),
    Mutant("replay-share-expected", "a step replays share x prompts in expectation, not rounded to whole prompts",
           "src/stagetrain/grpo/steps.py", "    return whole + (rng.random() < exact - whole)", "    return round(exact)",
           ("tests/test_grpo_math.py::test_replay_holds_its_share_in_expectation_where_rounding_would_not",)),
    Mutant("replay-nothing-at-n", "replay with nothing to replay fails snakemake -n",
           "src/stagetrain/config/settings.py", "        if replay.share and replay.families is None and", "        if False and replay.families is None and",
           ("tests/test_config.py::test_replay_with_nothing_to_replay_fails_the_dry_run",)),
    Mutant("nothing-solved-warning", "a run in which nothing reached success_at is warned of",
           "src/stagetrain/grpo/train.py", '    if not logged or any(r["reward/solved"] for r in logged):', "    if True:",
           ("tests/test_grpo_math.py::test_a_run_that_solved_nothing_is_warned_with_its_largest_reward",)),
    Mutant("solved-share", "reward/solved counts the completions that reached success_at",
           "src/stagetrain/grpo/steps.py", '"reward/solved": sum(sum(row.solved) for row in rows) / len(rewards)', '"reward/solved": 0.0',
           (GRPO + "test_flat_grpo_trains_through_the_engine_with_a_reference",)),
    Mutant("hub-path-inside-repo", "a hub file path with '..', '/' first or a backslash fails -n in one line",
           "src/stagetrain/config/settings.py", '    if "\\\\" in path or any(part in ("", ".", "..") for part in path.split("/")):', "    if False:",
           ("tests/test_config.py::test_a_hub_file_outside_its_repo_fails_the_dry_run_in_one_line",)),
    Mutant("evaluate-manifest-sizes", "evaluate holds a consolidated folder's files to its manifest's sizes",
           "src/stagetrain/evaluate/accuracy.py", "            if isinstance(listed, int) and size != listed:", "            if False:",
           ("tests/test_heldout.py::test_evaluate_on_a_cut_shard_is_one_line_naming_it",)),
    Mutant("evaluate-load-one-line", "a folder transformers cannot load is one line in evaluate",
           "src/stagetrain/evaluate/accuracy.py", "    except Exception as err:  # safetensors'", "    except StageError as err:  # safetensors'",
           ("tests/test_heldout.py::test_evaluate_on_a_cut_shard_is_one_line_naming_it",)),
    Mutant("max-rows-cap", "a file family holds at most tasks.max_rows problems",
           "src/stagetrain/tasks/families.py", "            if len(heap) < max_rows:", "            if True:",
           (TASKS + "test_a_family_past_max_rows_keeps_the_same_sample_in_bounded_memory",)),
    Mutant("max-rows-sample", "the capped sample is the lowest hashes, not the files' first rows",
           "src/stagetrain/tasks/families.py", "            elif rank < -heap[0][0]:", "            elif False:",
           (TASKS + "test_a_family_past_max_rows_keeps_the_same_sample_in_bounded_memory",)),
    Mutant("render-hash-order", "a DeepSpeed config renders byte for byte alike in every process",
           "src/stagetrain/training/deepspeed_config.py", '    check(config, ranks=layout.dp * layout.tp, where=f"deepspeed/{stage}.json")\n    return config',
           '    check(config, ranks=layout.dp * layout.tp, where=f"deepspeed/{stage}.json")\n    return {k: config[k] for k in set(config)}',
           ("tests/test_deepspeed_config.py::test_rendering_is_byte_identical_across_processes_and_hash_seeds",)),
    Mutant("split-fixed", "a problem's split is a fixed function of its key in every process",
           "src/stagetrain/tasks/problem.py", '    bucket = int.from_bytes(digest[:8], "big") % 100', "    bucket = hash(key) % 100",
           ("tests/test_tasks.py::test_split_of_is_a_fixed_function_of_the_key",)),
    Mutant("json-array", "a .json file of one array of rows (Dataset.to_json(lines=False)) is read as rows",
           "src/stagetrain/tasks/files.py", '            if kind == ".json" and _starts_array(handle):', "            if False:",
           (TASKS + "test_a_json_file_as_datasets_writes_it_loads_the_same_family",)),
    Mutant("task-suffix-at-n", "a task file without a readable suffix fails the config check (-n), before any stage",
           "src/stagetrain/config/settings.py", "                if suffix_of(name) is None and not", "                if False and not",
           (TASKS + "test_unreadable_files_are_one_line",)),
    Mutant("per-reward-metrics", "each reward term's unweighted mean is logged by its name, None rows left out",
           "src/stagetrain/grpo/steps.py", "        scored = [v for n, v in terms if n == name and not math.isnan(v)]",
           "        scored = [0.0 if math.isnan(v) else v for n, v in terms if n == name]",
           ("tests/test_grpo_math.py::test_each_reward_term_is_logged_by_name_as_trl_does_its_none_rows_left_out",
            "tests/test_grpo_tasks.py::test_grpo_trains_on_own_families_with_their_rewards_and_template")),
    Mutant("rank-error-once", "bad input every rank meets is logged once",
           "src/stagetrain/training/launch.py", "                if line in said:", "                if False:",
           ("tests/test_pretrain_unit.py::test_bad_input_met_by_every_rank_is_one_line_not_torchruns_traceback",)),
    Mutant("rank-error-no-traceback", "after a rank's error line, torchrun's ChildFailedError report stays out of the log",
           "src/stagetrain/training/launch.py", "            elif first_error is not None:\n                continue",
           "            elif False:\n                continue",
           ("tests/test_pretrain_unit.py::test_bad_input_met_by_every_rank_is_one_line_not_torchruns_traceback",)),
    Mutant("corpus-share-repeated", "a source that runs out is read again to fill its weight's share",
           "src/stagetrain/corpus/shards.py", "                while done.tokens < budget:", "                for _ in range(1):",
           ("tests/test_corpus.py::test_a_short_source_is_read_again_to_fill_its_share",)),
    Mutant("corpus-share-bounded", "a source far too small for its share is refused, not read thousands of times",
           "src/stagetrain/corpus/shards.py", "                        and budget / part.tokens > MAX_PASSES\n", "                        and False\n",
           ("tests/test_corpus.py::test_a_short_source_is_read_again_to_fill_its_share",)),
    Mutant("reward-import-checked", "a reward a file imports from the environment is checked at -n as that module's own",
           "src/stagetrain/tasks/reward_source.py", "    elif isinstance(node, ast.ImportFrom) and _environment_module(node):",
           "    elif False:",
           (TASKS + "test_reward_signatures_are_checked_at_dag_time_files_by_ast_modules_by_signature",)),
    Mutant("trainer-scores-the-nucleus", "the trainer scores sampled tokens on the sampler's top-p distribution",
           "src/stagetrain/grpo/steps.py", '    policy: dict[str, Any] = {"temperature": run.cfg.temperature, "top_p": run.cfg.top_p}',
           '    policy: dict[str, Any] = {"temperature": run.cfg.temperature, "top_p": 1.0}',
           (GRPO + "test_flat_grpo_trains_through_the_engine_with_a_reference",)),
    Mutant("grpo-trains", "GRPO's loss reaches the weights through the engine",
           "src/stagetrain/grpo/steps.py", "engine.backward(total * ga * run.layout.dp)", "engine.backward(total * 0.0)",
           (GRPO + "test_flat_grpo_trains_through_the_engine_with_a_reference",)),
    Mutant("grpo-longest-completion", "a step's record names its longest completion, which sets how long its decoding ran",
           "src/stagetrain/grpo/steps.py", '"completions/max_length": max(', '"completions/max_length": min(',
           (GRPO + "test_flat_grpo_trains_through_the_engine_with_a_reference",)),
    Mutant("sampler-policy", "the loss scores the policy that sampled (temperature, top-p)",
           "src/stagetrain/grpo/steps.py", "scores = policy_scores(logits, temperature, top_p, keep=tokens)",
           "scores = logits.float()",
           ("tests/test_grpo_sampling.py::test_the_trainer_scores_the_tokens_as_the_sampler_drew_them",)),
    Mutant("shared-prompt-positions", "completions scored over their shared prompt's cache sit at their own positions",
           "src/stagetrain/grpo/shared_prompts.py", "[[len(p) + j for j in range(longest)] for p, _ in items]",
           "[[width + j for j in range(longest)] for p, _ in items]",
           (SHARED + "[False]", "tests/test_grpo_sampling.py::test_the_trainer_scores_the_tokens_as_the_sampler_drew_them")),
    Mutant("shared-prompt-last-logits", "the prompts' forward computes logits at each prompt's last position alone",
           "src/stagetrain/grpo/shared_prompts.py", "use_cache=True,\n                 logits_to_keep=1, ", "use_cache=True,\n                 ",
           (SHARED + "[False]",)),
    Mutant("shared-prompt-checkpointing", "a graph whose layers checkpoint (and drop a cache) scores whole rows",
           "src/stagetrain/grpo/shared_prompts.py", "    if not torch.is_grad_enabled():\n        return True",
           "    if True:\n        return True",
           (SHARED + "[True]",)),
    Mutant("shared-prefill-rows", "a prompt prefilled once feeds its own group's rows, flat and tree",
           "src/stagetrain/grpo/prefix_cache.py", "return k.repeat_interleave(n, 0), v.repeat_interleave(n, 0)",
           "return k.repeat(n, 1, 1, 1), v.repeat(n, 1, 1, 1)",
           ("tests/test_grpo_sampling.py::test_the_trainer_scores_the_tokens_as_the_sampler_drew_them",
            "tests/test_grpo_prefix_cache.py")),
    Mutant("global-normaliser", "GRPO's loss is normalised over the global batch (a dp change resumes)",
           "src/stagetrain/grpo/steps.py", "_dp_sums(\n        run, [sum(sizes), sum(kl_sizes), tokens]\n    )", "[sum(sizes), sum(kl_sizes), tokens]",
           ("tests/test_grpo_math.py::test_train_on_makes_the_global_batchs_update_however_dp_and_accumulation_cut_it",)),
    Mutant("global-sampling-key", "a prompt's completions are keyed by its global index, not its rank's",
           "src/stagetrain/grpo/steps.py", "(run.spec[\"seed\"], step_no, first + i)", "(run.spec[\"seed\"], step_no, i)",
           (GRPO + "test_grpo_on_two_ranks_resumes_on_one",)),
    Mutant("held-out-every-family", "the held-out evaluation covers the corpus's families, not only the curriculum's",
           "src/stagetrain/grpo/train.py", "evaluated_families(cfg.curriculum.families, meta)",
           "list(cfg.curriculum.families)",
           (GRPO + "test_tree_rollouts_share_prefixes_under_zero3",)),
    Mutant("replay-leaves-curriculum", "replayed families never move the curriculum",
           "src/stagetrain/grpo/curriculum.py", "if family in by_family and level ==",
           "if level ==",
           ("tests/test_grpo_math.py::test_replay_puts_its_share_of_other_families_in_each_step_and_leaves_the_curriculum",)),
    Mutant("weights-only", "DeepSpeed's own checkpoint readers go through the weights-only unpickler",
           "src/stagetrain/training/integrity.py", 'os.environ[FORCE] = "1"', "pass",
           ("tests/test_checkpoint_integrity.py::test_deepspeeds_own_reader_refuses_a_crafted_file_under_weights_only_loads",)),
    Mutant("group-timeout", "every process group, DeepSpeed's too, gets the collective timeout",
           "src/stagetrain/training/engine.py", "    bound_every_group(timeout)\n", "\n",
           ("tests/test_pretrain_unit.py::test_a_group_made_after_the_world_times_out_as_the_world_does",)),
    Mutant("nan-refused", "a non-finite loss stops the run before a checkpoint of it is saved",
           "src/stagetrain/training/metrics.py", 'if precision != "fp16" and not math.isfinite(value):',
           "if False:", ("tests/test_pretrain_dist.py::test_a_diverged_run_stops_with_one_line_before_saving",)),
    Mutant("pointer-rebuilt", "tags without latest.json resume instead of starting fresh over them",
           "src/stagetrain/training/integrity.py", "        return rebuild_pointer(folder, layout)", "        return None",
           ("tests/test_checkpoint_integrity.py::test_tags_without_a_pointer_rebuild_it_and_survive_the_next_save",)),
    Mutant("save-failure-cleaned", "a save that cannot be written (full disk) leaves no partial tag",
           "src/stagetrain/training/checkpoints.py", "        shutil.rmtree(self.folder / tag, ignore_errors=True)\n        why",
           "        why",
           ("tests/test_checkpoint_integrity.py::test_a_save_that_cannot_be_written_is_one_line_and_leaves_no_partial_tag",)),
    Mutant("prune-listed-only", "a save prunes only tags its pointer listed",
           "src/stagetrain/training/checkpoints.py", "reshard.source_tag(old.name) in dropped",
           "reshard.source_tag(old.name) not in complete",
           ("tests/test_checkpoint_integrity.py::test_a_save_never_prunes_a_tag_its_pointer_did_not_list",)),
    Mutant("finite-numbers", "a non-finite number in the config is refused before any stage runs",
           "src/stagetrain/config/validation.py", '{"integer": _is_whole_number, "number": _is_finite_number}',
           '{"integer": _is_whole_number}',
           ("tests/test_config.py::test_a_non_finite_number_is_refused_for_every_number_key",)),
    Mutant("grpo-checked-at-dag-time", "GRPO settings that keys decide together fail with the config",
           "src/stagetrain/config/settings.py", "        self.grpo.check()\n", "",
           ("tests/test_config.py::test_grpo_settings_that_keys_decide_together_fail_with_the_config",)),
    Mutant("curriculum-checked-when-built", "a curriculum that would promote and demote at once fails with the config",
           "src/stagetrain/config/settings.py", "        if self.demote_below >= self.promote_at:", "        if False:",
           ("tests/test_config.py::test_grpo_settings_that_keys_decide_together_fail_with_the_config",)),
    Mutant("literals-are-the-schemas", "each settings enum is a Literal of exactly the schema's values",
           "src/stagetrain/config/settings.py", '    loss_type: Literal["grpo", "dapo", "dr_grpo"]', '    loss_type: Literal["grpo", "dapo"]',
           ("tests/test_settings.py::test_every_dataclass_has_exactly_the_schemas_keys",)),
    Mutant("record-names-its-dataclass", "a JSON record cast from a dataclass names exactly its fields",
           "src/stagetrain/hardware/report.py", "    pcie_gbps: float\n    source: str\n", "    pcie_gbps: float\n",
           ("tests/test_contracts.py::test_the_records_written_from_a_dataclass_name_its_fields",
            "tests/test_hardware_nvml.py::TestNvmlNode::test_eight_h100s")),
    Mutant("digest-reads-types-only", "a stage that reads another's artifact digests its type, not the code that writes it",
           "src/stagetrain/grpo/train.py", "from stagetrain.consolidate.manifest import Manifest", "from stagetrain.consolidate.folder import Manifest",
           ("tests/test_inputs.py::test_a_stage_digests_the_types_it_reads_not_the_code_that_writes_them",)),
    Mutant("init-from-matches", "init_from weights must match their config (none missing, extra or mis-shaped)",
           "src/stagetrain/training/engine.py", "        if keys:\n            raise StageError(\n                f\"model.init_from",
           "        if False:\n            raise StageError(\n                f\"model.init_from",
           ("tests/test_pretrain_unit.py::test_init_from_weights_that_do_not_match_their_config_are_one_line",)),
    Mutant("control-tokens-stay-text", "a corpus file's control-token text is encoded as text, not as special ids",
           "src/stagetrain/corpus/shards.py", "tokenizer.encode_special_tokens = not source.controls",
           "tokenizer.encode_special_tokens = False",
           ("tests/test_corpus.py::test_control_token_text_in_corpus_files_stays_text",)),
    Mutant("replay-families-at-dag-time", "replay families are checked with the config, not inside the GRPO ranks",
           "src/stagetrain/config/settings.py", '("grpo.replay.families", self.grpo.replay.families or ())',
           '("grpo.replay.families", ())',
           ("tests/test_config.py::test_replay_families_are_checked_with_the_config",)),
    Mutant("exactly-once-data", "each data-parallel rank reads its own share of a step's windows",
           "src/stagetrain/training/batches.py", "[dp_rank * per_rank : (dp_rank + 1) * per_rank]", "[:per_rank]",
           ("tests/test_pretrain_unit.py",
            "tests/test_pretrain_dist.py::test_two_ranks_match_one_rank_with_the_same_global_batch")),
    Mutant("code-digest", "a stage reruns when a module it runs changes",
           "src/stagetrain/workflow/codedeps.py", "        digest.update(path.read_bytes())\n", "\n",
           ("tests/test_reruns.py::test_an_edited_library_module_reruns_the_stages_that_run_it",)),
    Mutant("rerun-matrix", "a stage reruns when a config key it reads changes",
           "workflow/rules/grpo.smk", '        grpo=config["grpo"],\n', "",
           ("tests/test_reruns.py::test_rerun_matrix_over_every_config_key",)),
    Mutant("rewards-weighted", "a family's reward is the weighted sum of its terms",
           "src/stagetrain/tasks/rewards.py", "total[i] += reward.weight * value", "total[i] += value",
           (TASKS + "test_user_rewards_get_the_extra_columns_and_are_weighted",
            "tests/test_grpo_tasks.py::test_grpo_trains_on_own_families_with_their_rewards_and_template")),
    Mutant("reward-columns", "reward functions receive the rows' columns by name",
           "src/stagetrain/tasks/rewards.py", "        **{c: [copy.deepcopy(p.columns.get(c)) for p in problems] for c in columns},\n", "",
           (TASKS + "test_user_rewards_get_the_extra_columns_and_are_weighted",)),
    Mutant("reward-checked", "a non-finite reward stops the stage in one line",
           "src/stagetrain/tasks/rewards.py", "return number if math.isfinite(number) else None", "return number",
           (TASKS + "test_a_failing_reward_function_is_one_line_naming_file_function_and_row",)),
    Mutant("reward-keywords", "rewards are called as TRL calls them: by keyword only, with its state and log sinks",
           "src/stagetrain/tasks/rewards.py", "    out = reward.function(**kwargs)\n",
           '    out = reward.function(kwargs.pop("prompts"), kwargs.pop("completions"), **kwargs)\n',
           (TASKS + "test_rewards_are_called_by_keyword_only_with_trl_state_logs_and_every_column",)),
    Mutant("reward-trainer-state", "a reward's trainer_state is the step being scored and the run's last",
           "src/stagetrain/tasks/judge.py", "TrainerState(global_step=step, max_steps=max_steps)", "TrainerState()",
           (TASKS + "test_rewards_are_called_by_keyword_only_with_trl_state_logs_and_every_column",)),
    Mutant("reward-async", "an async reward function is awaited",
           "src/stagetrain/tasks/rewards.py", "return asyncio.run(_awaited(out)) if inspect.isawaitable(out) else out",
           "return out", (TASKS + "test_an_async_reward_is_awaited",)),
    Mutant("reward-copies", "each reward call gets copies of the columns: a function cannot change the problems",
           "src/stagetrain/tasks/rewards.py", "[copy.deepcopy(p.columns.get(c)) for p in problems]",
           "[p.columns.get(c) for p in problems]",
           (TASKS + "test_a_reward_gets_copies_and_cannot_change_the_stored_problems",)),
    Mutant("reward-base-exception", "a reward raising SystemExit or KeyboardInterrupt is a one-line reward error",
           "src/stagetrain/tasks/rewards.py", "    except BaseException as err:  # noqa: BLE001",
           "    except Exception as err:  # noqa: BLE001",
           (TASKS + "test_base_exceptions_overflowing_values_and_infinite_sums_are_one_line",)),
    Mutant("reward-overflow", "a returned int too large for a float is a one-line reward error",
           "src/stagetrain/tasks/rewards.py", "    except (OverflowError, ValueError):\n", "    except ValueError:\n",
           (TASKS + "test_base_exceptions_overflowing_values_and_infinite_sums_are_one_line",)),
    Mutant("reward-module", "a reward may name an installed module's function, module:name",
           "src/stagetrain/tasks/reward_source.py", '(source.endswith(".py") or MODULE.fullmatch(source))',
           'source.endswith(".py")',
           (TASKS + "test_trl_rewards_run_unchanged_from_a_module_and_a_factory",)),
    Mutant("reward-factory", "a reward with kwargs is what its factory returns for them",
           "src/stagetrain/tasks/reward_source.py", "    if kwargs is None:\n        return function\n    try:",
           "    return function\n    try:",
           (TASKS + "test_trl_rewards_run_unchanged_from_a_module_and_a_factory",)),
    Mutant("reward-signature-file", "a file's reward that cannot take TRL's keyword call is refused at DAG time",
           "src/stagetrain/tasks/reward_source.py", '            _refuse(key, f"{path}:{name}", ast_params(node), keywords)',
           "            pass",
           (TASKS + "test_reward_signatures_are_checked_at_dag_time_files_by_ast_modules_by_signature",)),
    Mutant("reward-signature-module", "a module's reward that cannot take TRL's keyword call is refused at DAG time",
           "src/stagetrain/tasks/reward_source.py", "    _refuse(key, what, signature_params(found), keywords)\n    return None",
           "    return None",
           ("tests/test_inputs.py::test_a_missing_local_file_is_one_line_naming_its_key",)),
    Mutant("reward-not-function", "an imported reward that is not a function is refused",
           "src/stagetrain/tasks/reward_source.py", "if not (inspect.isfunction(found) or inspect.isbuiltin(found)):",
           "if False:",
           (TASKS + "test_reward_signatures_are_checked_at_dag_time_files_by_ast_modules_by_signature",)),
    Mutant("conversational-completions", "a conversational family's completions reach rewards as TRL's assistant messages",
           "src/stagetrain/tasks/rewards.py", '[{"role": "assistant", "content": c.text}]', "c.text",
           (TASKS + "test_a_conversational_family_is_prompted_through_the_chat_template_and_scored_by_trl_rewards",)),
    Mutant("conversational-prompt", "a prompt column of messages makes a conversational problem, as TRL decides",
           "src/stagetrain/tasks/families.py", "if is_conversational(raw_prompt) else None", "if False else None",
           (TASKS + "test_a_conversational_family_is_prompted_through_the_chat_template_and_scored_by_trl_rewards",)),
    Mutant("trained-chat-template", "the trained tokenizer carries the chat template that renders the pipeline's markup",
           "src/stagetrain/tokenizer/build.py", "    tokenizer.chat_template = CHAT_TEMPLATE\n", "",
           (TASKS + "test_a_conversational_family_is_prompted_through_the_chat_template_and_scored_by_trl_rewards",)),
    Mutant("reward-finite-sum", "a weighted sum that overflows to inf is a one-line error naming the reward",
           "src/stagetrain/tasks/rewards.py", "                if not math.isfinite(total[i]):", "                if False:",
           (TASKS + "test_base_exceptions_overflowing_values_and_infinite_sums_are_one_line",)),
    Mutant("chat-template", "prompts are rendered with the tokenizer's chat template when it has one",
           "src/stagetrain/tasks/prompts.py", "    return bool(chat_template and template and template != CHAT_TEMPLATE)",
           "    return False",
           (TASKS + "test_a_chat_template_renders_prompts_token_for_token",
            "tests/test_grpo_tasks.py::test_grpo_trains_on_own_families_with_their_rewards_and_template")),
    Mutant("held-out-by-rewards", "the held-out evaluation solves by the family's rewards and success_at",
           "src/stagetrain/training/evaluation.py", "float(judge.solved(p, r))", "float(r >= 1.0)",
           ("tests/test_grpo_tasks.py::test_grpo_trains_on_own_families_with_their_rewards_and_template",)),
    Mutant("task-split", "a file family's problems split by a hash of the prompt (held-out never trains)",
           "src/stagetrain/tasks/families.py", "pool.setdefault((problem.level, split_of(problem.key)), [])",
           'pool.setdefault((problem.level, "train"), [])',
           (TASKS + "test_every_format_loads_the_same_family", "tests/test_corpus.py::test_task_families_join_the_corpus_in_their_split")),
    Mutant("reward-file-input", "a reward file is a declared input of GRPO (an edit reruns it, nothing upstream)",
           "workflow/rules/common.smk", '    return LOCAL_INPUTS["reward_files"]', "    return []",
           ("tests/test_reruns.py::test_an_edited_reward_file_reruns_grpo_and_nothing_upstream",)),
    Mutant("prompt-lengths-checked", "a file-family prompt longer than max_prompt_len as rendered stops GRPO before any step",
           "src/stagetrain/grpo/train.py", '            judge.prompter.check_lengths([p for problems in fam.pool.values() for p in problems])',
           "            pass",
           ("tests/test_grpo_tasks.py::test_a_prompt_too_long_as_rendered_stops_before_the_engines",)),
    Mutant("generated-prompt-lengths", "a generated family's prompts longer than max_prompt_len stop GRPO before any step, never cut",
           "src/stagetrain/tasks/prompts.py", "        if len(ids) > self.limit:", "        if False:",
           (TASKS + "test_a_generated_familys_prompts_longer_than_max_prompt_len_stop_grpo_before_any_step",)),
    Mutant("universal-complete", "a universal copy missing a file is converted again, not reused",
           "src/stagetrain/training/reshard.py", "        if missing is None:\n", "        if True:\n",
           ("tests/test_reshard.py::test_a_universal_copy_missing_a_file_is_converted_again_from_its_intact_tag",)),
    Mutant("generation-batch-from-plan", "rollouts generate at most the plan's generation batch per call",
           "src/stagetrain/grpo/train.py", 'generation_batch=plan["stages"]["grpo"]["generation"]["batch"]', "generation_batch=10**6",
           (GRPO + "test_flat_grpo_trains_through_the_engine_with_a_reference",)),
    Mutant("import-cycle", "no module of the package imports itself back through others",
           "src/stagetrain/grpo/steps.py", "from stagetrain.grpo.run import Replay, Run\n",
           "from stagetrain.grpo.run import Replay, Run\nif True:\n    from stagetrain.grpo.train import fingerprinted\n",
           ("tests/test_lint.py::test_no_import_cycle_in_the_package",)),
    Mutant("save-failure-writer-only", "only torch.save's writer error counts as a save that could not be written",
           "src/stagetrain/training/checkpoints.py", 'if "inline_container" not in str(err) and "PytorchStreamWriter" not in str(err):',
           "if False:",
           ("tests/test_checkpoint_integrity.py::test_a_peer_gone_mid_save_is_not_called_a_write_failure",)),
    Mutant("checkpoint-folder-writable", "a checkpoint folder the run cannot write fails when the lock is taken",
           "src/stagetrain/training/checkpoints.py", "                _check_writable(self.folder)\n", "                pass\n",
           ("tests/test_checkpoint_integrity.py::test_a_checkpoint_folder_that_cannot_be_written_is_one_line_before_anything_is_built",)),
    Mutant("init-from-weight-files", "a damaged init_from safetensors file is one line naming it",
           "src/stagetrain/training/engine.py", 'for path in sorted(Path(folder).glob("*.safetensors")):', "for path in []:",
           ("tests/test_pretrain_unit.py::test_a_damaged_or_unsafe_init_from_weight_file_is_one_line_naming_it",)),
    Mutant("init-from-decoder", "an init_from model the planner cannot count is one line at planning",
           "src/stagetrain/model/config.py", '    _check_decoder(config, model.init_from)\n', "",
           ("tests/test_config.py::test_init_from_a_model_the_planner_cannot_count_is_one_line",)),
    Mutant("lock", "a second run of a stage stops before it writes",
           "src/stagetrain/training/checkpoints.py", "            raise StageError(error)\n", "            pass\n",
           (GRPO + "test_two_grpo_runs_at_once_one_trains_the_other_fails_in_one_line",)),
    Mutant("final-step-weights-only", "a complete stage rerun under a ZeRO change no format carries loads its weights alone",
           "src/stagetrain/training/checkpoints.py", 'final=point["step"] == final_step)', "final=False)",
           ("tests/test_pretrain_dist.py::test_a_complete_stage_rerun_under_a_zero_change_no_format_carries_loads_its_weights_alone",)),
    Mutant("report-what-exists", "a report after a run that stopped early shows the plots that exist",
           "workflow/rules/common.smk", '    if REPORT_ONLY and not glob.glob(re.sub(r"\\{[^{}]*\\}", "*", path)):', "    if False:",
           ("tests/test_commands.py::test_a_report_after_a_run_that_stopped_before_grpo_shows_what_exists",)),
    Mutant("lock-before-outputs", "a second run is refused before Snakemake deletes the live run's log",
           "workflow/rules/common.smk", '        refuse_while_running(Path(RUN).resolve() / "checkpoints", TRAINING_STAGES)', "        pass",
           ("tests/test_lifecycle.py::test_a_second_run_is_refused_in_one_line_and_no_rank_outlives_a_sigkilled_snakemake",)),
    Mutant("evaluation-split", "GRPO's held-out evaluation deals each chunk to one dp rank and scores every problem once",
           "src/stagetrain/grpo/train.py", "mine = chunks[run.dp_rank :: dp]", "mine = chunks[::dp]",
           ("tests/test_grpo_tasks.py::test_grpo_trains_on_own_families_with_their_rewards_and_template",)),
    Mutant("attention-from-plan", "the engine runs the plan's attention kernel",
           "src/stagetrain/training/engine.py", "    model.set_attn_implementation(attention)\n", "",
           (GRPO + "test_flat_grpo_trains_through_the_engine_with_a_reference",)),
    Mutant("verify-with-training-attention", "consolidation verifies with the kernel the stage trained with",
           "src/stagetrain/consolidate/folder.py", ', attn_implementation=summary["attention"]', "",
           ("tests/test_default_run.py::test_the_default_run_improves_on_held_out_problems_and_climbs_the_curriculum",)),
    Mutant("router-aux-loss", "an MoE model pretrains with its router's load-balancing loss",
           "src/stagetrain/training/experts.py", "return lm + routing.coef * aux, lm, aux, counts", "return lm, lm, aux, counts",
           ("tests/test_experts.py::test_the_training_loss_adds_the_architectures_aux_loss",
            "tests/test_experts.py::test_the_aux_loss_balances_the_experts_on_two_ranks[mixtral]")),
    Mutant("grpo-router-aux-loss", "grpo.router_aux_loss_coef adds an MoE policy's load-balancing loss to GRPO's",
           "src/stagetrain/grpo/steps.py",
           "total = total + cfg.router_aux_loss_coef * scored.aux_loss / (ga * run.layout.dp)", "total = total",
           ("tests/test_experts.py::test_grpo_trains_an_moe_policy_on_its_aux_loss_only_when_asked",)),
    Mutant("routing-position", "the sampler's routing of a token is the position that drew it, as the trainer scores it",
           "src/stagetrain/grpo/sampling.py", "self.calls.append(chosen[:, -1].to(torch.int16).cpu())",
           "self.calls.append(chosen[:, 0].to(torch.int16).cpu())",
           ("tests/test_grpo_sampling.py::test_the_trainer_routes_the_sampled_tokens_as_the_sampler_did",)),
    Mutant("tree-routing-by-segment", "a tree leaf's sampler routing is its segments' in path order",
           "src/stagetrain/grpo/rollouts.py", "nodes = [tree.nodes[i] for i in tree.path(leaf)]",
           "nodes = [tree.nodes[i] for i in tree.path(leaf)][::-1]",
           ("tests/test_grpo_sampling.py::test_the_trainer_routes_the_sampled_tokens_as_the_sampler_did",)),
    Mutant("routing-stand-in-counted", "a token the sampler did not draw (a tree's stand-in eos) is not a routing flip",
           "src/stagetrain/grpo/steps.py", "drew = (mine >= 0).all(-1)", "drew = (mine >= -1).all(-1)",
           ("tests/test_grpo_sampling.py::test_the_trainer_routes_the_sampled_tokens_as_the_sampler_did",)),
    Mutant("universal-buffers", "a resume through a universal checkpoint keeps the model's buffers (deepseek_v3's routing bias)",
           "src/stagetrain/training/checkpoints.py", "restored = reshard.restore_buffers(engine.module, self.folder / options.tag)",
           "restored = []",
           ("tests/test_elastic.py::test_an_moe_run_killed_at_ep_2_and_rerun_on_one_rank_equals_the_uninterrupted_run",
            "tests/test_experts.py::test_a_deepseek_v3_routing_bias_survives_resume_and_consolidation")),
    Mutant("fast-loader-strict", "libyaml's parser refuses duplicate keys as PyYAML's does",
           "src/stagetrain/config/validation.py", "for _loader in (_StrictLoader, _FastStrictLoader):",
           "for _loader in (_StrictLoader,):",
           ("tests/test_config.py::test_duplicate_yaml_keys_are_rejected_with_file_and_line",
            "tests/test_config.py::test_yaml_merge_keys_are_read_and_explicit_keys_win")),
    Mutant("autoep-rendered", "a layout with ep > 1 turns AutoEP on",
           "src/stagetrain/training/deepspeed_config.py", "    if layout.ep > 1:\n        # AutoEP", "    if False:\n        # AutoEP",
           ("tests/test_deepspeed_config.py::test_expert_parallelism_enables_autoep_where_the_plan_splits_experts",
            "tests/test_experts.py::test_expert_parallelism_trains_as_one_rank_does_and_resumes_across_ep")),
    Mutant("expert-share-memory", "under ep a rank holds 1/ep of the routed experts whole; ZeRO's partitions still cover the model",
           "src/stagetrain/planning/memory.py", "return split - shape.expert_params + shape.expert_params // ep", "return split",
           ("tests/test_planning.py::test_expert_parallelism_holds_a_share_of_the_experts_and_pays_their_all_to_all",)),
    Mutant("ep-all-to-all", "the throughput model charges ep its all-to-all",
           "src/stagetrain/planning/throughput.py", "ep_time = all_to_alls * shape.moe_layers * ep_bytes * ga / ep_bw", "ep_time = 0.0",
           ("tests/test_planning.py::test_expert_parallelism_holds_a_share_of_the_experts_and_pays_their_all_to_all",
            "tests/test_planning.py::test_the_planner_splits_experts_where_autoep_can_and_grpo_with_flat_rollouts")),
    Mutant("ep-checked-with-the-config", "an ep AutoEP cannot run is refused when the config is validated (snakemake -n)",
           "src/stagetrain/config/settings.py", "        self._check_expert_parallel()\n", "",
           ("tests/test_config.py::test_an_ep_that_cannot_run_fails_with_the_config",)),
    Mutant("autoep-counts", "under AutoEP the expert load counts the choices of AutoEP's own routers",
           "src/stagetrain/training/experts.py", "    if chosen:\n", "    if False:\n",
           ("tests/test_experts.py::test_expert_parallelism_trains_as_one_rank_does_and_resumes_across_ep",)),
    Mutant("autoep-expert-files", "an AutoEP checkpoint missing an expert's file is not complete",
           "src/stagetrain/training/integrity.py", 'if path == files[0] and layout.get("ep", 1) > 1', "if False",
           ("tests/test_experts.py::test_expert_parallelism_trains_as_one_rank_does_and_resumes_across_ep",)),
    Mutant("autoep-renamed", "a resume that turns AutoEP on or off, and consolidation, read its weights under the loading side's names",
           "src/stagetrain/training/reshard.py", "        if _autoep(old) != _autoep(new):", "        if False:",
           ("tests/test_experts.py::test_expert_parallelism_trains_as_one_rank_does_and_resumes_across_ep",)),
    Mutant("autoep-gated-shared", "a qwen2_moe's gated shared expert, AutoEP's shared_experts, is transformers' shared_expert again",
           "src/stagetrain/training/autoep.py", "    if gated_shared:\n", "    if False:\n",
           ("tests/test_experts.py::test_autoeps_names_turn_into_each_architectures_own_and_back",
            "tests/test_experts.py::test_an_aux_loss_moe_at_ep_2_trains_as_one_rank_does_its_aux_loss_included")),
    Mutant("autoep-optimizer-groups", "a copy saved without AutoEP gives AutoEP's experts' group its Adam state (ZeRO 1-2)",
           "src/stagetrain/training/reshard.py", '        _groups_for_autoep(zero / "optimizer_state.pt")', "        pass",
           ("tests/test_experts.py::test_expert_parallelism_trains_as_one_rank_does_and_resumes_across_ep",)),
    Mutant("universal-own-steps", "after a ZeRO-3 universal load every optimizer sub-group counts its own Adam steps",
           "src/stagetrain/training/reshard.py", 'state["step"] = step.clone()', 'state["step"] = step',
           ("tests/test_experts.py::test_expert_parallelism_trains_as_one_rank_does_and_resumes_across_ep",)),
    Mutant("autoep-gate-first", "transformers' fused projection splits into AutoEP's gate half first, its up half second",
           "src/stagetrain/training/autoep.py", "return layer + GATE, layer + UP", "return layer + UP, layer + GATE",
           ("tests/test_experts.py::test_expert_parallelism_trains_as_one_rank_does_and_resumes_across_ep",)),
    Mutant("consolidated-buffers", "a consolidated folder holds the checkpoint's buffers (deepseek_v3's routing bias), with or without AutoEP",
           "src/stagetrain/consolidate/weights.py", 'for name in model.get("buffer_names", ()):', "for name in ():",
           ("tests/test_experts.py::test_expert_parallelism_trains_as_one_rank_does_and_resumes_across_ep", "tests/test_experts.py::test_a_deepseek_v3_routing_bias_survives_resume_and_consolidation[2]")),
    Mutant("lmeval-catalogue-when-named", "a task named from lm-eval's catalogue is found there",
           "src/stagetrain/evaluate/lmeval.py", "include_defaults=len(files) < len(extra),",
           "include_defaults=False,",
           ("tests/test_evaluate.py::test_a_task_named_from_lm_evals_catalogue_is_found_there",)),
    Mutant("corpus-level-weights", "data.generated.level_weights sets the levels' shares of the corpus",
           "src/stagetrain/corpus/sources.py", "level = rng.choices(range(1, top + 1), weights)[0]",
           "level = rng.randint(1, top)",
           ("tests/test_corpus.py::test_level_weights_set_the_levels_shares_in_the_corpus",)),
    Mutant("router-bias-update", "a deepseek_v3 pretrains its routing bias towards balance after each optimizer step",
           "src/stagetrain/pretrain/train.py", "        balance_routers(run.engine.module, load, routing.bias_rate)\n",
           "        pass\n",
           ("tests/test_experts.py::test_the_aux_loss_balances_the_experts_on_two_ranks[deepseek_v3]",)),
    Mutant("router-bias-all-ranks", "every rank updates the routing bias from the tokens of all ranks, so the biases stay equal",
           "src/stagetrain/pretrain/train.py", "    dist.all_reduce(load, op=dist.ReduceOp.SUM)\n", "",
           ("tests/test_experts.py::test_a_deepseek_v3_routing_bias_survives_resume_and_consolidation[2]",)),
    Mutant("router-bias-counted", "the expert load counts the experts a biased router chose, not the top-k of its logits",
           "src/stagetrain/training/experts.py", "choice = scores.sigmoid() + bias.detach().float()", "choice = scores",
           ("tests/test_experts.py::test_the_experts_counted_are_the_ones_deepseeks_router_chooses",)),
    Mutant("router-bias-fp32-folder", "a bf16 folder holds the routing bias in fp32, as transformers keeps it",
           "src/stagetrain/consolidate/folder.py", "kept = kept_in_fp32(names, keep) if dtype != torch.float32 else set()",
           "kept = set()",
           ("tests/test_consolidate_unit.py::test_shards_mixing_fp32_into_bf16_are_the_bytes_of_save_file",)),
    Mutant("part-reruns-by-content", "a replan reruns a plan part's job, and its readers, only when the part changes",
           "workflow/rules/plan_parallelism.smk", "        digest=get_part_digest,", "        digest=planner_key,",
           ("tests/test_reruns.py::test_rerun_matrix_over_every_config_key",
            "tests/test_reruns.py::test_a_replan_runs_what_its_dry_run_listed")),
    Mutant("stages-off-plan-json", "no stage reads plan.json, which every planner edit rewrites",
           "workflow/rules/grpo.smk", '        plan=f"{RUN}/plan/grpo.json",\n',
           '        plan=f"{RUN}/plan/grpo.json",\n        whole=f"{RUN}/plan.json",\n',
           ("tests/test_reruns.py::test_rerun_matrix_over_every_config_key",)),
    Mutant("recorded-plan-by-inputs", "the DAG reuses plan.json only when it was planned from the same inputs",
           "src/stagetrain/planning/ahead.py", "recorded.get(INPUTS_KEY) == key", "recorded.get(INPUTS_KEY)",
           ("tests/test_reruns.py::test_a_replan_runs_what_its_dry_run_listed",)),
    Mutant("dag-without-torch", "a DAG build that counts no model shape imports neither torch nor transformers",
           "src/stagetrain/config/settings.py", "        arch = self.model.architecture\n",
           "        import stagetrain.model.config  # noqa: F401\n        arch = self.model.architecture\n",
           ("tests/test_reruns.py::test_rerun_matrix_over_every_config_key",)),
    Mutant("kept-imports-by-bytes", "a source's kept import names serve only its exact bytes",
           "src/stagetrain/workflow/codedeps.py", 'hashlib.sha256(f"{_name(path, root)}\\0".encode() + data)',
           'hashlib.sha256(f"{_name(path, root)}\\0".encode())',
           ("tests/test_inputs.py::test_kept_import_names_serve_only_the_bytes_they_were_parsed_from",)),
    Mutant("kept-shape-by-model", "a kept model shape is served only for the model section it was counted for",
           "src/stagetrain/planning/shape.py", '"model": asdict(model),', '"model": model.architecture,',
           ("tests/test_planning.py::test_a_kept_shape_is_the_counted_one_and_any_edit_to_its_inputs_counts_again",)),
    Mutant("comm-op-built", "a training rank joins without compiling DeepSpeed's inference-only CPU comm op",
           "src/stagetrain/training/engine.py", 'compatible["deepspeed_shm_comm"] = False',
           "pass",
           ("tests/test_pretrain_unit.py::test_a_rank_joins_without_building_deepspeeds_inference_comm_op",)),
    Mutant("op-probe-run", "a training rank joins without probing every DeepSpeed op",
           "src/stagetrain/training/engine.py", 'vars(deepspeed.ops).setdefault("__compatible_ops__", {})',
           "deepspeed.ops.__compatible_ops__",
           ("tests/test_pretrain_unit.py::test_a_rank_joins_without_probing_every_deepspeed_op",)),
    Mutant("harness-prompts-as-trained", "lm-eval is asked the prompts the stages render, special tokens included",
           "src/stagetrain/evaluate/lmeval.py", "text = tokenizer.decode(ids, skip_special_tokens=False)",
           "text = tokenizer.decode(ids, skip_special_tokens=True)",
           ("tests/test_evaluate.py::test_the_harness_scores_the_held_out_problems_as_the_pipeline_does",)),
    Mutant("harness-scores-its-own-problem", "each lm-eval completion is scored against the problem it answers",
           "src/stagetrain/evaluate/lmeval.py", "problem = self._problems[cell][doc[\"index\"]]",
           "problem = self._problems[cell][0]",
           ("tests/test_evaluate.py::test_the_harness_scores_the_held_out_problems_as_the_pipeline_does",)),
    Mutant("publish-keeps-the-repos-table", "a published layout is merged over the repo's table, not over nothing",
           "src/stagetrain/publish/push.py", "out = {gpu: dict(counts) for gpu, counts in existing.items() if isinstance(counts, Mapping)}",
           "out: dict[str, Any] = {}",
           ("tests/test_publish.py::test_a_published_table_is_what_the_next_plan_starts_from",)),
    Mutant("publish-gpu-layouts-only", "a run on CPU ranks publishes no layout table",
           "src/stagetrain/publish/push.py", "    if plan[\"device\"] == CPU:\n        return {}\n", "",
           ("tests/test_publish.py::test_publish_pushes_both_models_and_a_card_in_one_commit",)),
    Mutant("publish-only-listed-files", "publish pushes what MANIFEST.json lists, not whatever is in the folder (no Snakemake marker)",
           "src/stagetrain/publish/push.py", "for f in listed_files(Path(folder))\n", "for f in sorted(Path(folder).iterdir()) if f.is_file()\n",
           (PUSH + "test_a_folder_leaves_as_its_manifest_lists_it_and_no_marker",)),
    Mutant("publish-refuses-unlisted", "a file MANIFEST.json does not list refuses the push, naming it",
           "src/stagetrain/publish/push.py", '("not in MANIFEST.json", sorted(n for n, p in present.items()',
           '("not in MANIFEST.json", sorted(n for n, p in {}.items()',
           (PUSH + "test_a_folder_not_as_its_manifest_says_is_refused_in_one_line",)),
    Mutant("publish-refuses-symlinks", "a symlink in a model folder (its target could be a secret) refuses the push",
           "src/stagetrain/publish/push.py", '("symlinks", sorted(n for n, p in present.items() if p.is_symlink())),',
           '("symlinks", []),',
           (PUSH + "test_a_folder_not_as_its_manifest_says_is_refused_in_one_line",)),
    Mutant("publish-rehashes", "every listed file is hashed again against MANIFEST.json before it is pushed",
           "src/stagetrain/publish/push.py", 'return hashlib.file_digest(handle, "sha256").hexdigest() == entry.get("sha256")',
           "return True",
           (PUSH + "test_a_folder_not_as_its_manifest_says_is_refused_in_one_line",)),
    Mutant("publish-deadline", "a push to a hub that never answers ends within STAGETRAIN_HUB_PUSH_TIMEOUT_S",
           "src/stagetrain/publish/push.py", "with deadline(where):", 'with __import__("contextlib").nullcontext():',
           (PUSH + "test_a_hub_that_never_answers_fails_within_the_push_deadline",)),
    Mutant("publish-unreachable-one-line", "a hub that cannot be reached during a push is one line, not a traceback",
           "src/stagetrain/hub.py", "    except _http().RequestError as err:  # refused", "    except _GiveUp as err:  # refused",
           (PUSH + "test_an_unreachable_hub_is_one_line",)),
    Mutant("publish-table-is-an-object", "a repo's layout table that is not a JSON object is one line, not a traceback",
           "src/stagetrain/publish/push.py", "    if not isinstance(existing, dict):\n", "    if False:\n",
           (PUSH + "test_a_layout_table_that_is_not_a_json_object_is_one_line",)),
    Mutant("publish-repo-at-dag-time", "`snakemake -n publish` without publish.repo fails in one line, before any job",
           "workflow/rules/common.smk", "    if SETTINGS.publish.repo is None:\n        sys.exit(", "    if False:\n        sys.exit(",
           ("tests/test_publish.py::test_publish_without_a_repo_fails_the_dry_run_in_one_line",)),
    Mutant("consolidate-full-disk-one-line", "a full disk during consolidation is one line naming the folder, nothing left",
           "src/stagetrain/consolidate/folder.py", "if isinstance(err, OSError) and err.errno is not None:", "if False:",
           ("tests/test_consolidate.py::test_a_full_disk_is_one_line_naming_the_folder_and_leaves_nothing",)),
    Mutant("generation-config-stops", "a consolidated folder's generate stops at eos and the next problem's marker, as the sampler does",
           "src/stagetrain/consolidate/folder.py", "eos_token_id=stops,", "eos_token_id=config.eos_token_id,",
           ("tests/test_consolidate.py::test_a_plain_generate_stops_where_the_pipelines_sampler_does",)),
    Mutant("card-license", "the published card declares publish.license in its front matter",
           "src/stagetrain/publish/card.py", "license=r.license,", "license=None,",
           ("tests/test_publish.py::test_publish_pushes_both_models_and_a_card_in_one_commit",)),
    Mutant("card-corpus-files", "the card names each corpus source's files, weight and tokens",
           "src/stagetrain/publish/card.py", "what = f\"local files {', '.join(f'`{f}`' for f in record['files'])}\"",
           "what = f\"{len(record['files'])} local file(s)\"",
           (PUSH + "test_the_card_names_each_corpus_source_by_its_files_weight_and_tokens",)),
    Mutant("card-grpo-settings", "the card gives the GRPO settings that shape the model",
           "src/stagetrain/publish/card.py", "KL coefficient {g.kl_coef:g}", "KL coefficient {g.clip_eps_low:g}",
           ("tests/test_publish.py::test_publish_pushes_both_models_and_a_card_in_one_commit",)),
    Mutant("card-generated-tokens", "the card's completion tokens are those GRPO's metrics record",
           "scripts/publish.py", 'int(v.get("rollout/generated_tokens", 0))', "0",
           ("tests/test_publish.py::test_publish_pushes_both_models_and_a_card_in_one_commit",)),
    Mutant("card-evaluations", "the card gives the evaluate target's results when they exist",
           "src/stagetrain/publish/card.py", "    if not r.evaluations:\n        return []", "    if True:\n        return []",
           ("tests/test_publish.py::test_publish_pushes_both_models_and_a_card_in_one_commit",)),
    Mutant("report-evaluation-table", "the report written after `evaluate` holds each model's evaluation table",
           "workflow/rules/common.smk", 'if REPORT_ONLY and not glob.glob(re.sub(r"\\{[^{}]*\\}", "*", path)):',
           "if REPORT_ONLY and not Path(path).exists():",
           ("tests/test_commands.py::test_a_report_after_evaluate_shows_the_evaluation_tables",)),
    Mutant("estimates-out-of-parts", "a forced detection that keeps a stage's layout does not rerun the stage",
           "src/stagetrain/planning/derived.py", "if k not in ESTIMATES}", "}",
           ("tests/test_precision.py::test_a_remeasured_machine_that_keeps_the_layouts_keeps_every_plan_part",)),
    Mutant("cpu-attention-probe", "the CPU model times attention by the probe, not the matrix rate (AMX, EPYC)",
           "src/stagetrain/planning/throughput.py", "attention_s_per_flop=None if attention_ms is None else attention_ms * 1e-3 / probe_flops",
           "attention_s_per_flop=None",
           ("tests/test_precision.py::test_the_cpu_model_predicts_every_recorded_run_within_30_percent",)),
    Mutant("corpus-formats", "a corpus file in any task-file format is read as its JSON lines",
           "src/stagetrain/corpus/sources.py", "    if suffix_of(path) is None:", '    if path.suffix != ".jsonl":',
           ("tests/test_corpus.py::test_compressed_and_parquet_corpora_read_as_their_json_lines",)),
    Mutant("module-own-config", "used as a module, the workflow reads the config it is given, not its own default",
           "Snakefile", " and not workflow.modifier.skip_configfile:", ":",
           ("tests/test_module.py::test_another_workflow_uses_it_as_a_module_and_plans",)),
    Mutant("zero3-reference", "under ZeRO-3 the KL term has its reference (DeepSpeed's eval() returns None)",
           "src/stagetrain/grpo/train.py", "        engine.eval()  # DeepSpeedEngine.eval returns None, not the engine as nn.Module's does\n        return engine",
           "        return engine.eval()",
           (GRPO + "test_tree_rollouts_share_prefixes_under_zero3",)),
    Mutant("reference-kl", "the KL term holds the policy to the frozen reference, not to itself",
           "src/stagetrain/grpo/steps.py", "token_logprobs(run.reference, c, run.device", "token_logprobs(run.engine, c, run.device",
           ("tests/test_golden.py::test_twenty_fp32_grpo_steps_give_the_golden_rewards_and_losses",)),
    Mutant("warmup-within-steps", "a warmup longer than the stage's optimizer steps fails snakemake -n",
           "src/stagetrain/config/settings.py", "    if warmup > steps:", "    if False:",
           ("tests/test_config.py::test_grpo_settings_that_keys_decide_together_fail_with_the_config",
            "tests/test_config.py::test_settings_that_would_truncate_or_freeze_silently_are_refused")),
    Mutant("autoep-registry-lent", "Mixtral's AutoEP preset edits transformers' output-capture registry in a form it can (ep > 1)",
           "src/stagetrain/training/engine.py", 'with keyed_output_registry() if "expert_parallel" in ds_config else nullcontext():',
           "with nullcontext():",
           ("tests/test_experts.py::test_an_aux_loss_moe_at_ep_2_trains_as_one_rank_does_its_aux_loss_included",)),
    Mutant("autoep-registry-by-model", "transformers reads the lent registry by model, and finds the router logits AutoEP retargeted",
           "src/stagetrain/training/autoep.py", "return super().get(str(key.__class__)) or {}", "return {}",
           ("tests/test_experts.py::test_an_aux_loss_moe_at_ep_2_trains_as_one_rank_does_its_aux_loss_included",)),
    Mutant("verify-where-it-fits", "the loss verification uses the GPU only where the model fits in its free memory",
           "src/stagetrain/planning/plan.py", "free is not None and need * 1.2 <= free", "free is not None",
           ("tests/test_consolidate_unit.py::test_the_loss_is_verified_on_the_gpu_only_where_the_model_fits_in_it",)),
    Mutant("consolidate-gpu-where-it-fits", "a consolidation job asks for a GPU only where its verified model fits one",
           "src/stagetrain/workflow/slurm.py", "one = gpu and verifies_on_gpu((mem_mb - RANK_HOST_MB) * MiB, device)", "one = gpu",
           ("tests/test_slurm.py::test_consolidation_asks_for_one_gpu_where_the_verified_model_fits_one",)),
    Mutant("consolidate-gpu-asked", "a consolidation job of a GPU plan asks for the GPU its verification runs on",
           "src/stagetrain/workflow/slurm.py", '"gres": "gpu:1" if one else None', '"gres": None',
           ("tests/test_slurm.py::test_consolidation_asks_for_one_gpu_where_the_verified_model_fits_one",
            "tests/test_cluster.py::test_a_two_node_gpu_plan_asks_for_eight_gpus_a_node_a_runtime_and_one_to_verify")),
    Mutant("activation-norms-counted", "the planner counts the activations a Llama block keeps, its norms' fp32 copies included",
           "src/stagetrain/planning/memory.py", "per_token = 2 * _norm(h, w) + w * (2 * h + 2 * h_kv + 4 * f) / tp",
           "per_token = (4 * h + (10 * h + 6 * h_kv + 8 * f) / tp) * w / 2",
           ("tests/test_planning.py::test_activations_are_what_autograd_saves",)),
    Mutant("final-norm-counted", "the planner counts the final norm's saved activations",
           "src/stagetrain/planning/memory.py", "final = tokens * _norm(shape.hidden_size, w)", "final = 0",
           ("tests/test_planning.py::test_activations_are_what_autograd_saves",)),
    Mutant("per-token-fallback", "where ZeRO-3's whole policy gathered for generation fits no layout, GRPO plans per-token gathering without that copy",
           "src/stagetrain/planning/resolve.py", "if whole and layout.zero_stage == 3 else 0", "if layout.zero_stage == 3 else 0",
           ("tests/test_planning.py::test_grpo_gathers_per_token_only_where_the_whole_policy_does_not_fit",)),
    Mutant("per-token-honoured", "GRPO's generation leaves ZeRO-3's partitions in place when the plan says per_token",
           "src/stagetrain/training/engine.py", "if engine.zero_optimization_stage() != 3 or not whole:",
           "if engine.zero_optimization_stage() != 3:",
           (GRPO + "test_zero3_generation_gathering_per_token_makes_what_the_gathered_policy_makes",)),
    Mutant("grpo-ep-planned", "GRPO with flat rollouts is planned at the config's ep",
           "src/stagetrain/planning/resolve.py", 'expert_parallel=grpo.rollout == "flat",', "expert_parallel=False,",
           ("tests/test_planning.py::test_the_planner_splits_experts_where_autoep_can_and_grpo_with_flat_rollouts",
            "tests/test_deepspeed_config.py::test_expert_parallelism_enables_autoep_where_the_plan_splits_experts")),
    Mutant("grpo-gathered-ep-share", "GRPO's policy gathered for generation under ZeRO-3 holds its ep share of the experts",
           "src/stagetrain/planning/resolve.py", "policy = params_per_rank(shape, layout.tp, layout.ep)",
           "policy = params_per_rank(shape, layout.tp)",
           ("tests/test_planning.py::test_expert_parallelism_holds_a_share_of_the_experts_and_pays_their_all_to_all",)),
    Mutant("grpo-ep-lockstep", "under expert parallelism every generate call runs in lockstep (synced_gpus)",
           "src/stagetrain/training/evaluation.py", "return partitioned or bool(autoep.routers(module))", "return partitioned",
           (EP_GRPO,)),
    Mutant("lockstep-spare-chunk", "in lockstep (per-token gathering, expert parallelism) a rank one held-out chunk short scores a spare one",
           "src/stagetrain/grpo/train.py", "lockstep = in_lockstep(run.engine.module)", "lockstep = False",
           (GRPO + "test_zero3_generation_gathering_per_token_makes_what_the_gathered_policy_makes", EP_GRPO)),
    Mutant("grpo-ep-routing", "under expert parallelism the sampler records the experts AutoEP's routers chose",
           "src/stagetrain/grpo/sampling.py", "self.index = autoep.CHOSEN", "self.index = 0", (EP_GRPO,)),
    Mutant("grpo-ep-trainer-routing", "under expert parallelism the trainer's routing is what AutoEP's routers chose",
           "src/stagetrain/grpo/steps.py", "    if chosen:  # expert parallelism", "    if False:  # expert parallelism",
           (EP_GRPO,)),
    Mutant("contract-key-misspelt", "a key a stage writes into a contract TypedDict is one the type names (the type check)",
           "src/stagetrain/training/loop.py", '"resumed_from_step": self.start,', '"resumed_from": self.start,',
           (TYPES,)),
    Mutant("contract-field-type", "a field a stage writes into a contract TypedDict has the type's type (the type check)",
           "src/stagetrain/consolidate/folder.py", '"step": summary["final_step"],', '"step": summary["checkpoint"]["tag"],',
           (TYPES,)),
)  # fmt: skip


def copy_tree(into: Path) -> None:
    """The working tree's files that git tracks or would track, copied under `into`."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file() or source.is_symlink():
            target = into / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target, follow_symlinks=False)


def clean_failures(tests: set[str]) -> set[str]:
    """The node ids among `tests` that fail on the clean tree (one run for all): a test that
    fails unmutated (broken, or failing under load) must not count as catching a mutant."""
    with tempfile.TemporaryDirectory(prefix="mutant-clean-") as tmp:
        copy = Path(tmp)
        copy_tree(copy)
        env = {**os.environ, "PYTHONPATH": str(copy / "src")}
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml",
                               str(copy / "clean.xml"), *sorted(tests)], cwd=copy, env=env, capture_output=True,
                              text=True)  # fmt: skip
        if not (copy / "clean.xml").exists():
            sys.exit(
                f"error: the clean tree's tests did not run:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
            )
        report = ElementTree.parse(copy / "clean.xml")
    failed = set()
    for case in report.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            module = case.get("classname", "").replace(".", "/")
            failed.add(f"{module}.py::{case.get('name')}")
    return failed


def fails(test: str, failed: set[str]) -> bool:
    """Whether the mutant's test `test` (a file, a function, or a function's parameters) holds a
    node id of `failed`."""
    return any(n == test or n.startswith((f"{test}[", f"{test}::")) for n in failed)


def run(mutant: Mutant) -> tuple[str, float]:
    """'caught', 'missed' or 'stale', and the seconds its tests took."""
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as tmp:
        copy = Path(tmp)
        copy_tree(copy)
        path = copy / mutant.path
        text = path.read_text()
        if text.count(mutant.before) != 1:
            return "stale", 0.0
        path.write_text(text.replace(mutant.before, mutant.after))
        env = {**os.environ, "PYTHONPATH": str(copy / "src")}
        began = time.monotonic()
        # In one process (-n 0): xdist's workers stopped by -x exit 2, "interrupted", not 1.
        done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-n", "0", "-p", "no:cacheprovider",
                               *mutant.tests], cwd=copy, env=env, capture_output=True, text=True)  # fmt: skip
        seconds = time.monotonic() - began
        if done.returncode == 1:
            return "caught", seconds
        if done.returncode == 0:
            return "missed", seconds
        sys.stderr.write(done.stdout[-2000:] + done.stderr[-2000:])
        return f"error (pytest exit {done.returncode})", seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and their tests")
    args = parser.parse_args()
    known = {m.name: m for m in MUTANTS}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        sys.exit(f"error: unknown mutant {unknown[0]!r} (known: {', '.join(known)})")
    chosen = [known[n] for n in args.names] or list(MUTANTS)
    if args.list:
        for m in chosen:
            print(
                f"{m.name}: {m.guarantee}\n    {m.path}: {m.before.strip()!r} -> {m.after.strip()!r}\n    "
                + "\n    ".join(m.tests)
            )
        return
    failed = clean_failures({t for m in chosen for t in m.tests})
    results = []
    for m in chosen:
        broken = [t for t in m.tests if fails(t, failed)]
        outcome, seconds = (f"broken: {broken[0]} fails unmutated", 0.0) if broken else run(m)
        results.append((m, outcome))
        print(f"{m.name:<26} {outcome:<8} {seconds:6.0f} s", flush=True)
    print("\n| mutant | guarantee | result |\n| --- | --- | --- |")
    for m, outcome in results:
        print(f"| {m.name} | {m.guarantee} | {outcome} |")
    missed = [m.name for m, outcome in results if outcome != "caught"]
    sys.exit(f"not caught: {', '.join(missed)}" if missed else 0)


if __name__ == "__main__":
    main()
