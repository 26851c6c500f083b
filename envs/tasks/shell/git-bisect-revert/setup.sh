# A repository whose checksum code broke somewhere in 26 commits.
set -e
git config --global init.defaultBranch main
mkdir calc && cd calc
git init -q
git config user.name "Bisect Bot"
git config user.email "bisect-bot@calc.test"
bad=$(python3 -c 'import random; print(random.Random(3141).randrange(6, 22))')
write_checksum() {  # $1 = 1 for the broken version; $2 = description text
    if [ "$1" = 1 ]; then dbl='d = d * 2 if i % 2 else d'; else dbl='d = d * 2 if i % 2 == 0 else d'; fi
    cat > checksum.py <<PY
"""Luhn check digits."""


def check_digit(number):
    total = 0
    for i, ch in enumerate(reversed(number)):
        d = int(ch)
        $dbl
        total += d - 9 if d > 9 else d
    return (10 - total % 10) % 10




def describe():
    return "$2"
PY
}
words=(tidy refactor docs config tune polish rename cleanup format bump)
desc="Luhn check digits"
for i in $(seq 1 26); do
    export GIT_AUTHOR_DATE="2024-03-$(printf %02d $(( (i + 1) / 2 )))T1$((i % 10)):00:00Z"
    export GIT_COMMITTER_DATE="$GIT_AUTHOR_DATE"
    broken=0; [ "$i" -ge "$bad" ] && broken=1
    [ $((i % 4)) = 0 ] && desc="Luhn check digits, rev $i"
    write_checksum "$broken" "$desc"
    if [ "$i" != "$bad" ]; then  # the culprit touches nothing else
        echo "setting_$i = $((i * 37 % 101))" >> config.py
        echo "- change $i: ${words[$((i % 10))]}" >> NOTES.md
    fi
    git add -A
    git commit -q -m "${words[$((i * 7 % 10))]}: step $i"
    [ "$i" = 1 ] && git tag v1.0
done
git log --oneline | wc -l
