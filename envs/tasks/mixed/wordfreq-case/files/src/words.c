#include <ctype.h>

#include "words.h"

static int is_word_char(int c)
{
    return c != EOF && c < 128 && isalnum(c);
}

int next_word(FILE *in, char *buf, size_t size)
{
    size_t n = 0;
    int c;

    while ((c = getc(in)) != EOF && !is_word_char(c))
        ;
    if (c == EOF)
        return 0;
    do {
        if (c == '\'') {
            /* An apostrophe belongs to the word only between two word characters. */
            int next = getc(in);
            if (!is_word_char(next)) {
                if (next != EOF)
                    ungetc(next, in);
                break;
            }
            if (n + 1 < size)
                buf[n++] = '\'';
            c = next;
        }
        if (n + 1 < size)
            buf[n++] = (char)c;
    } while ((c = getc(in)) != EOF && (is_word_char(c) || c == '\''));
    buf[n] = '\0';
    return 1;
}
