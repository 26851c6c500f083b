import random
import shlex
import unittest

from cmdline import join, parse_command, split


def shlex_or_error(line):
    try:
        return shlex.split(line)
    except ValueError:
        return ValueError


def ours_or_error(line):
    try:
        return split(line)
    except ValueError:
        return ValueError


class HiddenLexerTest(unittest.TestCase):
    def test_agrees_with_shlex_on_random_lines(self):
        rng = random.Random(2024)
        alphabet = ["a", "b", " ", "\t", "'", '"', "\\", "$", "x y"]
        for _ in range(4000):
            line = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
            self.assertEqual(ours_or_error(line), shlex_or_error(line), repr(line))

    def test_agrees_with_shlex_on_examples(self):
        for line in [
            r'"a\\b" "c\"d" "e\f" "\\\"" x\\y',
            r'''echo "it's" 'say "hi"' "\'"''',
            r'"\"" "\\" "\$HOME" "tab\there"',
            r'a"\""b "x"\ "y" \"\"',
        ]:
            self.assertEqual(split(line), shlex.split(line), line)

    def test_join_round_trip_random(self):
        rng = random.Random(7)
        chars = "ab '\"\\$\t*"
        for _ in range(500):
            argv = ["".join(rng.choice(chars) for _ in range(rng.randint(0, 6))) for _ in range(rng.randint(1, 4))]
            self.assertEqual(split(join(argv)), argv, argv)

    def test_command_with_backslashes(self):
        cmd = parse_command(r'MSG="a \"b\" \c" run "x\\y"')
        self.assertEqual((cmd.env, cmd.argv), ({"MSG": 'a "b" \\c'}, ["run", "x\\y"]))


if __name__ == "__main__":
    unittest.main()
