#!/bin/bash
cd /tmp
D=/work/main/bench/results/2026-11-27-zen3-networks-3
P=/work/venv/bin/python
# warm the cost cache (plans timed once), then the measured runs
for m in resnet18 mobilenet_v2 vgg11; do $P -m tilegemm run $m --threads 1 --repeats 2 > /dev/null 2>&1; done
$P -m tilegemm run resnet18 --threads 1 --repeats 20 --both-plans > $D/resnet18-1t.txt 2>&1
$P -m tilegemm run mobilenet_v2 --threads 1 --repeats 20 --both-plans > $D/mobilenet_v2-1t.txt 2>&1
$P -m tilegemm run vgg11 --threads 1 --repeats 12 --both-plans > $D/vgg11-1t.txt 2>&1
$P -m tilegemm run resnet18 --batch 8 --threads 2 --repeats 8 --scaling > $D/resnet18-b8-2t.txt 2>&1
$P -m tilegemm run mobilenet_v2 --batch 8 --threads 2 --repeats 8 --scaling > $D/mobilenet_v2-b8-2t.txt 2>&1
for i in 1 2 3; do $P -m tilegemm run mobilenet_v2 --threads 1 --repeats 20 2>&1 | grep -E "best"; echo; done > $D/mobilenet_v2-1t-repeats.txt
for i in 1 2 3; do $P -m tilegemm run resnet18 --threads 1 --repeats 15 2>&1 | grep -E "best"; echo; done > $D/resnet18-1t-repeats.txt
for i in 1 2 3; do $P -m tilegemm run vgg11 --threads 1 --repeats 3 2>&1 | grep -E "^load"; done > $D/vgg11-load.txt
echo DONE
