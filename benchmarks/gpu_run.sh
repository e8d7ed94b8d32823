#!/usr/bin/env bash
# On the lent GPU machine (its own torch, transformers, triton and peft): install what its stack
# lacks from the wheels carried in .whl/ (libcst, liger-kernel), then run each argument as a step,
# printing each step's time and status; later steps run even if one fails. Exit: the first failure's.
#
#   bash benchmarks/gpu_run.sh "python -m pytest -q tests/test_low_rank.py" "python benchmarks/bench_train.py --out \$OUT/train"
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then
    # ``python -m pip``: the machine's ``pip`` may belong to another interpreter.
    python -m pip install --no-deps -q --root-user-action=ignore .whl/*.whl
fi
python -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
status=0
for step in "$@"; do
    echo "=== $step"
    start=$(date +%s)
    bash -c "$step"
    code=$?
    echo "=== exit $code after $(( $(date +%s) - start )) s: $step"
    if [ "$code" -ne 0 ] && [ "$status" -eq 0 ]; then status=$code; fi
done
exit "$status"
