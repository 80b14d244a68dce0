#!/usr/bin/env bash
# The GPU checks of docs/results.md §5, for a CUDA machine with torch but without dpmerge's other
# dependencies and without network: CUDA tests, GPU timings, and the non-convex study on
# ResNet-18-GN. Prepare, on a machine with network, in the repository root:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#     -d .whl pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.7.0 typing-inspection \
#     dp-accounting==0.6.0 dm-tree==0.1.10 opacus==1.6.0
#   cp /usr/share/datasets/fashion-mnist/* .data/fashion-mnist/   # IDX files (CIFAR-10 stand-in)
# Then run `scripts/gpu_check.sh OUT_DIR` on the GPU machine.
set -o pipefail
OUT=${1:-gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MLFLOW_DISABLE_TELEMETRY=true
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"; } | tee "$OUT/env.log"
python3 -m pytest -q --noconftest -p no:cacheprovider tests/test_merging.py tests/test_training.py \
  -k "gpu or cuda" 2>&1 | tail -5 | tee "$OUT/gpu_tests.log"
python3 benchmarks/bench_training.py --threads 16 --repeats 2 --device cuda --dataset cifar10-shaped \
  --models cnn resnet18_gn 2>&1 | grep '^|' | tee "$OUT/bench_training_cuda.log"
python3 benchmarks/bench_merge.py --device cuda --repeats 3 2>&1 | tail -6 | tee "$OUT/bench_merge_cuda.log"
python3 scripts/idx_to_cifar_format.py .data/fashion-mnist /tmp/fcifar > /dev/null
python3 -c "import sys; from dpmerge.cli import main; sys.exit(main(sys.argv[1:]))" study non-convex \
  --model resnet18-gn --dataset cifar10 --data-root /tmp/fcifar --limit 30000 --device cuda \
  --sigmas 1,2 --epochs 2 --grid 2 --path-points 3 --no-structured --threads 16 --no-mlflow \
  --results "$OUT/non-convex" 2>&1 | tail -30 | tee "$OUT/nonconvex_gpu.log"
