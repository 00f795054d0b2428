#!/usr/bin/env bash
# The short-fine-tune comparison of docs/results.md: AdamW, SAM, SL-SAM as in the paper,
# Random-SL-SAM, each remedy alone and combined (the retired "robust" preset), 5 seeds,
# on both offline tasks at their short budgets (vision: 92 and 276 steps, text: 454 steps).
#
#   bash examples/scripts/compare_short_runs.sh [OUT] [all|vision|vision92|vision276|text]
#
# OUT defaults to docs/results. On a 2-core CPU one torch thread per run is faster than two
# for the vision model, so its two tables were made by two processes side by side, one
# thread each (each table's epoch times are measured under the same load); the text model
# gains from two threads and ran alone:
#   OMP_NUM_THREADS=1 bash examples/scripts/compare_short_runs.sh docs/results vision92 &
#   OMP_NUM_THREADS=1 bash examples/scripts/compare_short_runs.sh docs/results vision276
#   bash examples/scripts/compare_short_runs.sh docs/results text
# Each task runs the baselines and the combined remedies first, then each remedy alone, then
# tabulates everything; an interrupted run continues where it stopped (--resume).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-docs/results}
tasks=${2:-all}
case $tasks in all | vision | vision92 | vision276 | text) ;;
  *) echo "tasks must be all, vision, vision92, vision276 or text, not '$tasks'" >&2; exit 2 ;;
esac
cli=${CLI:-python -m examples.compare}

# Each variant: a label, the method it configures, and its options. Every remedy is named
# by its options (not by a preset), so a label means the same configuration whatever the
# presets become: SLSAMAblation (slsam_ablation) on the paper's preset with each setting given
# alone (an uncapped update factor is 1 / layer_ratio = 5); the retired "robust" preset is the
# rank_head_scale row (until 2026-11-25 it also had the warm-up: the rank_warmup_head_scale row).
# Removed in 0.3, no option runs them any more (dense_warmup, dense_one_pass, min_updates retired; Random-SL-SAM scales updates only as preset='default', up to 3x): slsam_warmup, slsam_hybrid, slsam_budget, slsam_rank_warmup_head, random_warmup_head, slsam_rank_warmup_head_scale, random_warmup_head_scale, random_head_scale, random_head_cap2 -- they produced the committed runs of those labels in docs/results/short_vision_92, short_vision_276, short_text_454 and docs/results/gpu/*/runs/random_head_cap2 (and their rows of benchmarks/results/short_runs_time.md); rerunning them needs the code of commit f94ff83.
declare -A variant=(
  [slsam_rank]="slsam_ablation preset=paper bandit_loss=rank"
  [slsam_head]="slsam_ablation preset=paper head_always_active=true"
  [slsam_scale]="slsam_ablation preset=paper max_update_scale=5.0"
  [slsam_rank_head_scale]="slsam_ablation preset=paper bandit_loss=rank head_always_active=true max_update_scale=5.0"
  # The robust remedies under a compute budget (the bandit budgets parameters, not layers).
  [slsam_robust_compute]="slsam_ablation preset=paper budget=compute bandit_loss=rank head_always_active=true max_update_scale=5.0"
  [slsam_rank_head_compute]="slsam_ablation preset=paper budget=compute bandit_loss=rank head_always_active=true"
  # The update factor capped (max_update_scale; uncapped it is 1 / layer_ratio = 5), beside
  # the uniform twin of the cap at 3 (docs/results/gpu: the candidates for the default; cap 3
  # is SparseLayerSAM()'s and RandomSLSAM(preset='default')'s).
  [slsam_compute_cap2]="slsam_ablation preset=paper budget=compute bandit_loss=rank head_always_active=true max_update_scale=2"
  [slsam_compute_cap3]="slsam_ablation preset=paper budget=compute bandit_loss=rank head_always_active=true max_update_scale=3"
  [random_head_cap3]="random_slsam preset=default"
)
# The baselines and the paper's SL-SAM; the combination, each remedy alone, the compute
# budget.
core=adamw,sam,slsam_paper,random_slsam
combined=slsam_rank_head_scale
alone=slsam_rank,slsam_head,slsam_scale
compute=slsam_robust_compute,slsam_rank_head_compute

# compare DIR METHODS ARGS...: one compare of METHODS (comma-separated) into DIR.
compare() {
  local dir=$1 methods=$2 flags=() label words
  shift 2
  for label in ${methods//,/ }; do
    [[ -n ${variant[$label]:-} ]] || continue
    read -ra words <<<"${variant[$label]}"
    flags+=(--variant "$label=${words[0]}")
    for option in "${words[@]:1}"; do flags+=(--option "$label.$option"); done
  done
  $cli --methods "$methods" "${flags[@]}" --seeds 5 --resume --out "$dir" "$@"
}

# task DIR EXTRA CONFIG [-- trainer flags]: baselines and combinations first, then each
# remedy alone and the EXTRA configurations, then the whole table.
task() {
  local dir=$1 extra=$2 config=$3
  shift 3
  local args=(--config "$config" -- --trainer.enable_progress_bar=false "$@")
  compare "$dir" "$core,$combined" "${args[@]}"
  compare "$dir" "$compute" "${args[@]}"
  compare "$dir" "$alone$extra" "${args[@]}"
  compare "$dir" "$core,$combined,$compute,$alone$extra" "${args[@]}"
}

vision=examples/configs/tasks/efficientnet_digits.yaml
text=examples/configs/tasks/minilm_rotten_tomatoes.yaml
if [[ $tasks =~ ^(all|vision|vision92)$ ]]; then
  # Vision, 4 epochs (92 steps).
  task "$out/short_vision_92" "" "$vision"
fi
if [[ $tasks =~ ^(all|vision|vision276)$ ]]; then
  # Vision, 12 epochs (276 steps).
  task "$out/short_vision_276" "" "$vision" --trainer.max_epochs=12
fi
if [[ $tasks =~ ^(all|text)$ ]]; then
  # Text, 2 epochs (454 steps).
  task "$out/short_text_454" "" "$text"
fi
