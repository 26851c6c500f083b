import unittest

from cmdline import Command, expand_alias, parse_command


class CommandTest(unittest.TestCase):
    def test_assignments(self):
        cmd = parse_command('LANG=C TZ="Europe/Paris" sort -u "my file"')
        self.assertEqual((cmd.env, cmd.argv), ({"LANG": "C", "TZ": "Europe/Paris"}, ["sort", "-u", "my file"]))

    def test_assignment_later_is_an_argument(self):
        self.assertEqual(parse_command("make CC=clang all").argv, ["make", "CC=clang", "all"])

    def test_escaped_quotes_in_commit_message(self):
        cmd = parse_command(r'git commit -m "fix \"retry\" loop"')
        self.assertEqual(cmd.argv, ["git", "commit", "-m", 'fix "retry" loop'])

    def test_str(self):
        self.assertEqual(str(Command(["echo", "a b"], {"X": "1"})), "X=1 echo 'a b'")

    def test_alias(self):
        cmd = expand_alias('ll "My Documents"', {"ll": "ls -l --color=auto"})
        self.assertEqual(cmd.argv, ["ls", "-l", "--color=auto", "My Documents"])

    def test_empty(self):
        with self.assertRaises(ValueError):
            parse_command("   ")
        with self.assertRaises(ValueError):
            parse_command("A=1")


if __name__ == "__main__":
    unittest.main()
