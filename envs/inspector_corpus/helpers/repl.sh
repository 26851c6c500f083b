# Start a Python REPL fed through a fifo (corpus helper): source it in the session.
# The session keeps the fifo's write end open on fd 7; `repl 'code'` sends a line.
mkfifo /tmp/repl.in
python3 -q -u -i < /tmp/repl.in > /tmp/repl.out 2>&1 &
exec 7>/tmp/repl.in
repl() { printf '%s\n' "$1" >&7; sleep 0.3; }
