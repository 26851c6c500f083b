# Every CASE.in in the directory given (default tests/cases), run through
# ./wordfreq with the options in CASE.args (if any), must print CASE.out.
set -u
dir=${1:-tests/cases}
bin=${WORDFREQ:-./wordfreq}
failed=0
total=0
for input in "$dir"/*.in; do
    name=${input%.in}
    args=$(cat "$name.args" 2>/dev/null || true)
    total=$((total + 1))
    # shellcheck disable=SC2086 # the options are words
    if ! diff -u "$name.out" <($bin $args < "$input") > /dev/null; then
        echo "FAIL $(basename "$name")"
        diff -u "$name.out" <($bin $args < "$input") | sed 's/^/    /'
        failed=$((failed + 1))
    fi
done
echo "$((total - failed))/$total cases pass"
[ "$failed" -eq 0 ]
