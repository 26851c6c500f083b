#!/bin/bash
# Deploys release 7 over /app/site: some files change, some appear, some go.
# (The list of changes is generated per machine and deleted after the run.)
set -e
cd "$(dirname "$0")"
bash .deploy-plan.sh
rm -f .deploy-plan.sh
echo "deployed"
