#!/bin/bash
# How a mega-pretrain run ended, from its run folder (not from torchrun's exit code, which is 1
# whenever torchrun itself was signalled, however cleanly its workers saved and exited).
#
#   bash examples/slurm_exit_status.sh runs/<name>
#
# Exit status: 0 the run is done (train.steps reached, checkpoint committed);
#              10 it stopped cleanly before the end (a signal or exit_interval) and its
#                 checkpoint is committed as latest: resume it (requeue the job);
#              1 no clean end is recorded: it failed, or was killed before its save finished.
# The trainer writes <run>/run_end only after its last checkpoint is committed; remove the
# file before a launch so that an earlier attempt's end cannot speak for this one.
set -uo pipefail
run_dir=${1:?usage: slurm_exit_status.sh RUN_DIR}
end_file="$run_dir/run_end"
if [[ ! -f $end_file ]]; then
  echo "$run_dir: no clean end recorded ($end_file missing): the run failed or was killed" >&2
  exit 1
fi
state="" by="" step="" steps="" checkpoint=""
while IFS='=' read -r key value; do
  case $key in
    state) state=$value ;;
    by) by=$value ;;
    step) step=$value ;;
    steps) steps=$value ;;
    checkpoint) checkpoint=$value ;;
  esac
done <"$end_file"
latest=$(cat "$run_dir/checkpoints/latest" 2>/dev/null || true)
if [[ -z $checkpoint || $latest != "$checkpoint" || ! -d $run_dir/checkpoints/$checkpoint ]]; then
  echo "$run_dir: the end names checkpoint '$checkpoint' but checkpoints/latest names" \
    "'$latest'; not a clean end" >&2
  exit 1
fi
case $state in
  done)
    echo "$run_dir: done at step $step of $steps, checkpoint $checkpoint"
    exit 0
    ;;
  stopped)
    echo "$run_dir: stopped by $by at step $step of $steps, checkpoint $checkpoint saved"
    exit 10
    ;;
esac
echo "$run_dir: unknown state '$state' in $end_file" >&2
exit 1
